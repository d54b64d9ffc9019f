"""``hp-rewrite cost PLAN MODEL_DIR``: per-rank FLOPs, all-to-all bytes, memory and time of the MoE layers
(``--suggest`` ranks EP degrees, ``--calibrate`` measures this machine)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from .common import console, typed


@dataclass(frozen=True)
class CostArgs:
    json: bool
    calibrate: bool
    out: Path | None


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2,4") from None
    if not sizes or any(x < 1 for x in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be >= 1")
    return sizes


def register(sub) -> None:
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
    co.add_argument("--tp", type=int, default=None,
                    help="tensor parallel: a TP group shares one micro-batch, each rank routes 1/tp of its "
                    "tokens to complete experts (default: the plan's tp_size)")
    co.add_argument("--tp-sizes", type=_sizes, default=None,
                    help="with --suggest: the TP degrees to rank too, e.g. 1,2,4 (default: --tp only)")
    co.add_argument("--cp", type=int, default=None,
                    help="context parallel: a context group shares one micro-batch, each rank holds 1/cp of its "
                    "tokens and attention exchanges heads for positions (default: the plan's cp_size)")
    co.add_argument("--cp-sizes", type=_sizes, default=None,
                    help="with --suggest: the context degrees to rank too, e.g. 1,2,4 (default: --cp only)")
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
    co.add_argument("--lora", type=int, default=0, metavar="R",
                    help="cost LoRA fine-tuning: a frozen base, adapters of rank R on the routed experts "
                    "(PEFT target_parameters; fp32 adapters, gradients and AdamW)")
    co.add_argument("--keep-quantized", action="store_true",
                    help="with --lora: the experts held as the checkpoint's MXFP4 / FP8 codes and scales "
                    "(from_pretrained(..., quantization_config=...(dequantize=False)))")
    co.add_argument("--colocated-vllm", type=float, default=None, metavar="F",
                    help="RL with vLLM on the same GPUs (TRL's vllm_mode='colocate'): the memory each rank holds, "
                    "line by line, beside the F (vllm_gpu_memory_utilization) of the device vLLM takes; with "
                    "--world-size W, --non-expert replicate (default) or fully_shard, --lora R")
    co.add_argument("--balance-skew", type=float, default=None, metavar="S",
                    help="runtime.balance: forecast the first MoE layer's expert time, without and with balancing, "
                    "for a batch whose busiest EP rank gets S x the mean rows (the plan's balance knobs when it sets "
                    "balance: auto, else the break-even rows of --hardware)")
    co.add_argument("--trust-remote-code", action="store_true",
                    help="build the checkpoint's own modeling code (its config.json auto_map), as transformers' "
                    "trust_remote_code=True; read that code first")
    co.set_defaults(run=_run)


def _run(ns) -> int:
    from ..cost.run import CostRequest

    return cost(typed(CostArgs, ns), typed(CostRequest, ns))


def cost(args: CostArgs, request) -> int:
    from ..cost.report import colocated_table, cost_table, memory_lines, suggest_table, time_line
    from ..cost.run import calibrate_to, estimate_cost

    if args.calibrate:
        cal, out = calibrate_to(args.out)
        h = cal.hardware
        console.print(
            f"matmul: {h.flops_per_s / 1e9:.3g} GFLOP/s per rank; all-to-all: alpha {h.alpha_s * 1e6:.3g} us, "
            f"beta {h.beta_Bps / 1e9:.3g} GB/s ({len(cal.points)} sizes); wrote {out} "
            "(use it with --hardware-file)"
        )
        return 0
    report = estimate_cost(request)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
        return 0
    spec, result, hw = report.spec, report.cost, report.hardware
    console.print(cost_table(result, {lay.path: lay for lay in spec.layers}))
    sources = {c.loads.source for c in result.layers}
    reasons = sorted({c.loads.reason for c in result.layers if c.loads.reason})
    console.print(f"routing: {', '.join(sorted(sources))}" + (f" ({'; '.join(reasons)})" if reasons else ""))
    confirmed = sorted({lay.confirmed for lay in spec.layers})
    if spec.excluded or spec.unmatched:
        console.print(
            f"not costed: {len(spec.excluded)} block(s) excluded by the plan, unmatched (left unmodified): "
            f"{', '.join(spec.unmatched) or 'none'}",
            highlight=False,
        )
    console.print(f"archetypes: {', '.join(confirmed)}" + "".join(f"; {n}" for n in spec.notes))
    load = report.load
    what = f"{load.format} checkpoint, dequantised to {load.dequantized_to}" if load.dequantized_to else load.format
    if request.keep_quantized:
        what = f"{load.format} checkpoint, the experts kept as stored, the rest dequantised to {load.dequantized_to}"
    console.print(f"load: each rank reads {load.per_rank / 1e9:.3g} GB of the {load.total / 1e9:.3g} GB checkpoint "
                  f"({what}; experts {load.expert_bytes / 1e9:.3g} GB over ep {load.ep})", highlight=False)
    for line in memory_lines(result, hw, report.reserve_bytes, request.keep_quantized and load.format) + [
            time_line(report.time, hw)]:
        console.print(line, highlight=False)
    if report.candidates:
        console.print(suggest_table(report.candidates, request.world_size, hw))
    if report.colocated is not None:
        console.print(colocated_table(report))
    if report.balance is not None:
        b = report.balance
        verdict = "pays" if b.pays else "does not pay" if b.lent else "moves nothing"
        console.print(f"balance (runtime.balance: auto, ep {b.ep}): rows max/mean {b.skew:.2f} -> {b.balanced_skew:.2f}, "
                      f"{b.lent} expert copies per layer and step, the busiest rank's expert time "
                      f"{b.time_off_s * 1e3:.3g} -> {b.time_on_s * 1e3:.3g} ms (x{b.ratio:.3f}): balancing {verdict} "
                      f"(a copy pays from {b.min_rows} rows: runtime.balance_min_rows; it sends "
                      f"{b.copy.sent_bytes / 2**20:.3g} MiB and gets {b.copy.returned_bytes / 2**20:.3g} MiB back)",
                      highlight=False)
    return 0
