"""The context-parallel layer's user-facing error."""

from ..errors import UserError


class ContextParallelError(UserError, ValueError):
    """A model or input the context group cannot split exactly; the message names the field or module and
    the fix."""
