"""The ``hp-rewrite`` command line: argument parsing only; the work is in commands.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__


def _run(fn, *args) -> int:
    """Call a command; user errors end with a one-line message and exit code 2, no traceback."""
    from .commands import UserError, console
    from .plan import PlanError
    from .runtime import ExpertParallelError

    try:
        return fn(*args)
    except (UserError, PlanError, ExpertParallelError) as e:
        console.print(f"[red]error:[/] {e}", highlight=False)
        return 2


def _apply(args: argparse.Namespace) -> int:
    from .commands import apply

    return _run(apply, args.plan, args.model_dir, args.out, args.nproc, args.verify, args.report, args.timeout)


def _inspect(args: argparse.Namespace) -> int:
    from .commands import inspect_artifact

    return _run(inspect_artifact, args.dir, args.block, args.diff)


def _make_tiny(args: argparse.Namespace) -> int:
    from .commands import make_tiny_checkpoint

    model_type, out_dir = args.model_type, args.out_dir
    if args.from_config is not None and out_dir is None:  # `make-tiny --from-config SRC OUT_DIR`
        model_type, out_dir = None, Path(args.model_type) if args.model_type else None
    if out_dir is None:
        return _run(_missing_out_dir)
    return _run(make_tiny_checkpoint, model_type, out_dir, args.from_config, args.seed)


def _missing_out_dir() -> int:
    from .commands import UserError

    raise UserError("make-tiny needs an OUT_DIR")


def _describe(args: argparse.Namespace) -> int:
    from .match.describe import describe_moe

    return _run(describe_moe, args.model_dir, args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hp-rewrite",
        description="Expert-parallel rewriting of Hugging Face transformers Mixture-of-Experts models.",
    )
    parser.add_argument("--version", action="version", version=f"hp-rewrite {__version__}")
    sub = parser.add_subparsers(dest="command")

    ap = sub.add_parser("apply", help="match the MoE blocks of a checkpoint, generate expert-parallel forwards, "
                        "optionally run and verify them on local ranks")
    ap.add_argument("plan", type=Path, help="YAML parallel plan (see plans/)")
    ap.add_argument("model_dir", type=Path, help="transformers checkpoint directory (config.json + weights)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where generated code goes (default: the plan's output.dir, else ./hp-rewrite-out)")
    ap.add_argument("--nproc", type=int, default=None, help="run the rewritten model on N local ranks (gloo)")
    ap.add_argument("--verify", action="store_true", help="with --nproc: compare logits and every gradient with "
                    "the unmodified model; exit 1 beyond tolerance")
    ap.add_argument("--report", type=Path, default=None, help="write a JSON report here")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before a hung run is stopped")
    ap.set_defaults(func=_apply)

    ins = sub.add_parser("inspect", help="print the generated code (or its diff against the original forwards)")
    ins.add_argument("dir", type=Path, help="an artifact directory, or the --out directory of apply")
    ins.add_argument("--block", default=None, help="only the forward generated for this class")
    ins.add_argument("--diff", action="store_true", help="print the unified diff instead of the code")
    ins.set_defaults(func=_inspect)

    des = sub.add_parser(
        "describe-moe",
        help="list the MoE blocks of a checkpoint (config.json only): structure, "
        "the archetype hp-rewrite would use or why none fits, and a plan to start from",
    )
    des.add_argument(
        "model_dir", type=Path, help="transformers checkpoint directory (only config.json is read)"
    )
    des.add_argument("--json", action="store_true", help="print a JSON document on stdout instead of tables")
    des.set_defaults(func=_describe)

    mt = sub.add_parser("make-tiny", help="write a small random-weight checkpoint of any MoE model type "
                        "(no download), to try a plan on an architecture")
    mt.add_argument("model_type", nargs="?", default=None, help="transformers model type, e.g. qwen3_moe")
    mt.add_argument("out_dir", nargs="?", type=Path, default=None, help="new directory to write")
    mt.add_argument("--from-config", type=Path, default=None, help="shrink the config.json found in this directory")
    mt.add_argument("--seed", type=int, default=0)
    mt.set_defaults(func=_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
