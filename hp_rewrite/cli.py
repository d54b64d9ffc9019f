"""The ``hp-rewrite`` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _selfcheck(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .launch import WorldError, run_world
    from .runtime import ExpertParallelError, RuntimeOptions
    from .selfcheck import FP32_TOL, TINY

    console = Console()
    if args.model_type not in TINY:
        console.print(
            f"[red]error:[/] --model-type {args.model_type!r}: choose one of {', '.join(sorted(TINY))}"
        )
        return 2
    ep_size = args.ep_size or args.nproc
    if args.nproc < 1 or args.nproc % ep_size:
        console.print(f"[red]error:[/] --ep-size {ep_size} must divide --nproc {args.nproc}")
        return 2
    try:
        options = RuntimeOptions(compute=args.compute, chunks=args.chunks, overlap=not args.no_overlap)
    except ExpertParallelError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    payload = {
        "model_type": args.model_type,
        "ep_size": ep_size,
        "batch_per_rank": 2,
        "seq_len": 16,
        "options": options.as_dict(),
    }
    console.print(f"selfcheck: tiny {args.model_type}, {args.nproc} gloo ranks, ep_size {ep_size}, {options}")
    try:
        results = run_world(args.nproc, "hp_rewrite.selfcheck:run_rank", payload, timeout=args.timeout)
    except WorldError as e:
        console.print(f"[red]error:[/] a rank failed:\n{e}")
        return 1
    table = Table(title="expert-parallel vs unmodified transformers (fp32)")
    for col in (
        "rank",
        "logits rel err",
        "worst grad rel err",
        "worst grad",
        "EP fwd+bwd s",
        "ref fwd+bwd s",
    ):
        table.add_column(col)
    ok = True
    for rank, r in enumerate(results):
        ok &= r["logits_rel_err"] <= FP32_TOL and r["grad_rel_err"] <= FP32_TOL
        table.add_row(
            str(rank),
            f"{r['logits_rel_err']:.2e}",
            f"{r['grad_rel_err']:.2e}",
            r["worst_grad"],
            f"{r['ep_seconds']:.2f}",
            f"{r['ref_seconds']:.2f}",
        )
    console.print("experts holders made expert-parallel:\n  " + "\n  ".join(results[0]["holders"]))
    console.print(table)
    console.print("[green]PASS[/]" if ok else f"[red]FAIL[/]: error above {FP32_TOL:.0e}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hp-rewrite",
        description="Expert-parallel rewriting of Hugging Face transformers Mixture-of-Experts models.",
    )
    parser.add_argument("--version", action="version", version=f"hp-rewrite {__version__}")
    sub = parser.add_subparsers(dest="command")
    sc = sub.add_parser(
        "selfcheck",
        help="run a tiny MoE model expert-parallel on local ranks and check it "
        "against the unmodified model (logits and all gradients)",
    )
    sc.add_argument("--model-type", default="qwen3_moe", help="transformers model type (default: qwen3_moe)")
    sc.add_argument("--nproc", type=int, default=2, help="local ranks (gloo on CPU); default 2")
    sc.add_argument("--ep-size", type=int, default=None, help="expert-parallel size (default: --nproc)")
    sc.add_argument("--compute", default="auto", help="auto | grouped | eager")
    sc.add_argument("--chunks", type=int, default=1, help="dispatch chunks (default 1)")
    sc.add_argument("--no-overlap", action="store_true", help="synchronous all-to-all")
    sc.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung world is stopped")
    sc.set_defaults(func=_selfcheck)
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
