"""``hp-rewrite make-tiny MODEL_TYPE OUT_DIR`` (or ``--from-config SRC OUT_DIR``): a small random-weight checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .common import console


@dataclass(frozen=True)
class MakeTinyArgs:
    model_type: str | None
    out_dir: Path
    from_config: Path | None
    seed: int
    quantize: str | None = None


def register(sub) -> None:
    mt = sub.add_parser("make-tiny", help="write a small random-weight checkpoint of any MoE model type "
                        "(no download), to try a plan on an architecture")
    mt.add_argument("model_type", nargs="?", default=None, help="transformers model type, e.g. qwen3_moe")
    mt.add_argument("out_dir", nargs="?", type=Path, default=None, help="new directory to write")
    mt.add_argument("--from-config", type=Path, default=None, help="shrink the config.json found in this directory")
    mt.add_argument("--seed", type=int, default=0)
    mt.add_argument("--quantize", choices=("mxfp4", "fp8"), default=None,
                    help="write it in bf16 and the quantised layout the Hub ships: mxfp4 (gpt-oss: fused expert "
                    "blocks and scales) or fp8 (DeepSeek-V3 / Qwen3-FP8: block-FP8 Linear weights, per expert)")
    mt.set_defaults(run=lambda ns: run(_args(ns)))


def _args(ns) -> MakeTinyArgs:
    model_type, out_dir = ns.model_type, ns.out_dir
    if ns.from_config is not None and out_dir is None:  # `make-tiny --from-config SRC OUT_DIR`
        model_type, out_dir = None, Path(ns.model_type) if ns.model_type else None
    if out_dir is None:
        raise UserError("make-tiny needs an OUT_DIR")
    if (model_type is None) == (ns.from_config is None):
        raise UserError("give a MODEL_TYPE or --from-config DIR (exactly one)")
    if ns.from_config is not None and not (ns.from_config / "config.json").is_file():
        raise UserError(f"--from-config {ns.from_config}: no config.json there")
    return MakeTinyArgs(model_type, out_dir, ns.from_config, ns.seed, ns.quantize)


def run(args: MakeTinyArgs) -> int:
    from ..tiny import make_tiny as write_tiny

    path = write_tiny(args.model_type, args.out_dir, from_config=args.from_config, seed=args.seed,
                      quantize=args.quantize)
    layout = f" ({args.quantize}, as the Hub ships it)" if args.quantize else ""
    console.print(f"wrote a tiny random-weight checkpoint{layout} to {path}")
    return 0
