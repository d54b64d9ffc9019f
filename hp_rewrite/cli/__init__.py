"""The ``hp-rewrite`` command line: one module per command, on top of the library.

Each command module has a ``register(subparsers)`` that adds its parser, parses into a typed
arguments object and calls the library. The library raises :class:`~hp_rewrite.errors.UserError`
subclasses; only :func:`main` turns them into a one-line message and exit code 2. Nothing in
the library imports this package.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__

#: command modules, in the order ``--help`` lists them
COMMANDS = ("apply", "inspect", "describe", "make_tiny", "cost", "profile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hp-rewrite",
        description="Expert-parallel rewriting of Hugging Face transformers Mixture-of-Experts models.",
    )
    parser.add_argument("--version", action="version", version=f"hp-rewrite {__version__}")
    sub = parser.add_subparsers(dest="command")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from ..errors import UserError
    from .common import console

    try:
        return args.run(args)
    except UserError as e:
        console.print(f"[red]error:[/] {e}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
