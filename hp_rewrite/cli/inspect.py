"""``hp-rewrite inspect DIR``: print the generated code, or its diff against the original forwards."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .common import console, typed


@dataclass(frozen=True)
class InspectArgs:
    dir: Path
    block: str | None
    diff: bool


def register(sub) -> None:
    ins = sub.add_parser("inspect", help="print the generated code (or its diff against the original forwards)")
    ins.add_argument("dir", type=Path, help="an artifact directory, or the --out directory of apply")
    ins.add_argument("--block", default=None, help="only the forward generated for this class")
    ins.add_argument("--diff", action="store_true", help="print the unified diff instead of the code")
    ins.set_defaults(run=lambda ns: inspect(typed(InspectArgs, ns)))


def inspect(args: InspectArgs) -> int:
    from rich.syntax import Syntax

    from ..codegen.show import generated_text

    text = generated_text(args.dir, args.block, args.diff)
    console.print(Syntax(text, "diff" if args.diff else "python", line_numbers=not args.diff, word_wrap=False))
    return 0
