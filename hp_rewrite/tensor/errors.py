"""The tensor-parallel layer's user-facing error."""

from ..errors import UserError


class TensorParallelError(UserError, ValueError):
    """A model or setting the TP layer cannot split exactly; the message names the module and the fix."""
