"""User-facing configuration errors of the runtime."""

from ..errors import UserError


class ExpertParallelError(UserError, ValueError):
    """A setting that cannot work (sizes that do not divide, a missing parameter, ...).

    The message names the value at fault and what to change; the CLI prints it without a traceback.
    """
