"""User-facing configuration errors of the runtime."""


class ExpertParallelError(ValueError):
    """A setting that cannot work (sizes that do not divide, a missing parameter, ...).

    The message names the value at fault and what to change; the CLI prints it without a traceback.
    """
