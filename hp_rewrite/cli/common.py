"""What every command shares: the console, and arguments parsed into a typed object."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import TypeVar

from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 160)

T = TypeVar("T")


def typed(cls: type[T], ns: argparse.Namespace) -> T:
    """The command's arguments dataclass, filled by field name from the parsed namespace."""
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})  # type: ignore[arg-type]
