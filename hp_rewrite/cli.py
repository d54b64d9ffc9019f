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


def _cost(args: argparse.Namespace) -> int:
    from .cost.commands import CostArgs, cost

    return _run(
        cost,
        CostArgs(
            args.plan,
            args.model_dir,
            args.seq_len,
            args.micro_batch,
            args.ep,
            args.etp,
            args.tp,
            args.cp,
            args.world_size,
            args.suggest,
            args.tokens_per_expert,
            args.json,
            args.hardware,
            args.hardware_file,
            args.dtype,
            args.reserve_gb,
            args.calibrate,
            args.out,
            args.non_expert,
        ),
    )


def _profile(args: argparse.Namespace) -> int:
    from .cost.commands import profile

    return _run(
        profile,
        args.plan,
        args.model_dir,
        args.tokens,
        args.ep,
        args.out,
        args.seq_len,
        args.batch,
        args.seed,
    )


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

    co = sub.add_parser(
        "cost",
        help="estimate per-rank FLOPs, all-to-all bytes, memory and time of the MoE "
        "layers (config.json only); --suggest ranks EP degrees; --calibrate measures this machine",
    )
    co.add_argument("plan", type=Path, nargs="?", help="YAML parallel plan (its ep_size unless --ep)")
    co.add_argument("model_dir", type=Path, nargs="?", help="checkpoint directory (only config.json is read)")
    co.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (s)")
    co.add_argument("--micro-batch", type=int, default=None, help="sequences per rank and micro-batch (b)")
    co.add_argument(
        "--ep", type=int, default=None, help="expert-parallel degree (default: the plan's ep_size)"
    )
    co.add_argument(
        "--etp", type=int, default=1, help="expert tensor parallel (divides expert FLOPs/weights)"
    )
    co.add_argument("--tp", type=int, default=1, help="tensor parallel (used for experts when --etp is 1)")
    co.add_argument("--cp", type=int, default=1, help="context parallel (divides the tokens of a rank)")
    co.add_argument("--world-size", type=int, default=None, help="ranks in all (EP x DP), for --suggest")
    co.add_argument(
        "--suggest",
        action="store_true",
        help="rank every ep that divides the world size and the "
        "experts by estimated step time, with memory per rank against the device capacity",
    )
    co.add_argument(
        "--tokens-per-expert",
        type=Path,
        default=None,
        help="profile.json from hp-rewrite profile (skew-aware: the busiest rank sets the pace)",
    )
    co.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    co.add_argument(
        "--hardware",
        default=None,
        help="preset: cpu-gloo, h100-nvlink, h200-nvlink (default), ascend910b-hccs",
    )
    co.add_argument(
        "--hardware-file",
        type=Path,
        default=None,
        help="JSON of hardware fields overriding the preset (e.g. written by --calibrate)",
    )
    co.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="training dtype (default: the config's, else bf16)",
    )
    co.add_argument(
        "--reserve-gb",
        type=float,
        default=0.0,
        help="memory per rank kept for everything outside the MoE layers",
    )
    co.add_argument(
        "--non-expert",
        choices=["replicate", "fully_shard"],
        help="with --suggest: cost every weight's states and the data-parallel collectives, non-expert weights "
        "replicated (DDP) or sharded with the experts over their replicas (hp_rewrite.fully_shard)",
    )
    co.add_argument(
        "--calibrate",
        action="store_true",
        help="measure matmul FLOP/s and all-to-all alpha/beta "
        "on 2 local gloo ranks; write a hardware JSON (--out)",
    )
    co.add_argument(
        "--out",
        type=Path,
        default=None,
        help="with --calibrate: where to write the JSON (default ./hp-rewrite-hardware.json)",
    )
    co.set_defaults(func=_cost)

    pr = sub.add_parser(
        "profile",
        help="run the model on token ids and record tokens per expert per MoE layer "
        "(JSON + heatmap PNG + imbalance per layer)",
    )
    pr.add_argument(
        "plan", type=Path, help="YAML parallel plan (selects the MoE layers; its ep_size unless --ep)"
    )
    pr.add_argument("model_dir", type=Path, help="checkpoint directory with weights")
    src = pr.add_mutually_exclusive_group()
    src.add_argument(
        "--tokens",
        type=Path,
        default=None,
        help="token ids: JSON list / list of lists, or text with one sequence of integers per line",
    )
    src.add_argument("--random", action="store_true", help="random token ids (the default)")
    pr.add_argument("--ep", type=int, default=None, help="group experts by owner rank for this ep")
    pr.add_argument("--out", type=Path, default=None, help="output directory (default ./hp-rewrite-profile)")
    pr.add_argument("--seq-len", type=int, default=128, help="with --random: tokens per sequence")
    pr.add_argument("--batch", type=int, default=8, help="with --random: sequences")
    pr.add_argument("--seed", type=int, default=0, help="with --random: seed of the token ids")
    pr.set_defaults(func=_profile)
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
