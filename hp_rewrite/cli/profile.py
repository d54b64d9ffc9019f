"""``hp-rewrite profile PLAN MODEL_DIR``: tokens per expert per MoE layer (JSON, heatmap PNG, imbalance);
``hp-rewrite profile --routing-log FILE``: the same from a training run's logged routing statistics."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .common import console, typed


@dataclass(frozen=True)
class ProfileArgs:
    plan: Path | None
    model_dir: Path | None
    tokens: Path | None
    ep: int | None
    out: Path | None
    seq_len: int
    batch: int
    seed: int
    trust_remote_code: bool = False
    routing_log: Path | None = None


def register(sub) -> None:
    pr = sub.add_parser(
        "profile",
        help="run the model on token ids and record tokens per expert per MoE layer "
        "(JSON + heatmap PNG + imbalance per layer)",
    )
    pr.add_argument(
        "plan", type=Path, nargs="?", help="YAML parallel plan (selects the MoE layers; its ep_size unless --ep)"
    )
    pr.add_argument("model_dir", type=Path, nargs="?", help="checkpoint directory with weights")
    pr.add_argument("--routing-log", type=Path, default=None,
                    help="instead of running a model: the hp_rewrite_routing.jsonl a training run prepared by "
                    "hp-rewrite wrote (its output_dir / project_dir), every logged step summed")
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
    pr.add_argument("--trust-remote-code", action="store_true",
                    help="run the checkpoint's own modeling code (its config.json auto_map), as transformers' "
                    "trust_remote_code=True; read that code first")
    pr.set_defaults(run=lambda ns: profile(typed(ProfileArgs, ns)))


def profile(args: ProfileArgs) -> int:
    from ..cost.report import profile_table
    from ..cost.run import profile_logged_routing, profile_routing

    if args.routing_log is not None:
        if args.plan is not None or args.model_dir is not None or args.tokens is not None:
            raise UserError("profile --routing-log reads a run's logged routing: give no PLAN, MODEL_DIR or --tokens")
        prof, ep, js, png = profile_logged_routing(args.routing_log, args.ep, args.out)
    elif args.plan is None or args.model_dir is None:
        raise UserError("profile needs PLAN and MODEL_DIR (or --routing-log FILE)")
    else:
        prof, ep, js, png = profile_routing(args.plan, args.model_dir, args.tokens, args.ep, args.out,
                                            args.seq_len, args.batch, args.seed, args.trust_remote_code)
    console.print(profile_table(prof, ep))
    console.print(f"wrote {js} and {png}")
    console.print(
        f"to place experts by this load, add to the plan:  placement: {{strategy: balanced, profile: {js.resolve()}}}",
        highlight=False,
    )
    return 0
