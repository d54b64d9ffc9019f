"""The errors the library raises for mistakes a user can fix.

Every layer raises a subclass of :class:`UserError` whose message names the field, file or module at
fault and what to do. Only the CLI (:mod:`hp_rewrite.cli`) turns them into a one-line message and exit
code 2; library callers catch them like any exception. This module imports nothing, so every layer
can use it.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (bad plan, bad model directory, wrong sizes, ...)."""


class ModelDirError(UserError, OSError):
    """The model directory is missing, has no readable config.json, or transformers cannot build it (an
    ``OSError``, as transformers raises for a directory it cannot read a model from)."""


class SelectionError(UserError):
    """The plan selects nothing to rewrite: a dense model, or include/exclude globs matching no block."""


class OutputError(UserError):
    """An output path that cannot be used (``--out`` is a file, an artifact is missing...)."""
