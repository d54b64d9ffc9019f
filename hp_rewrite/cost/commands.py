"""``hp-rewrite cost`` and ``hp-rewrite profile`` (argument parsing in cli.py, tables in report.py).

Each returns an exit code; mistakes the user can fix raise :class:`~hp_rewrite.commands.UserError`.
``cost`` needs only ``config.json`` (the model is built on the meta device, nothing allocated);
``profile`` runs the model, so it needs the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..commands import UserError, console, load_config, meta_model

_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class CostArgs:
    plan: Path | None
    model_dir: Path | None
    seq_len: int | None
    micro_batch: int | None
    ep: int | None = None
    etp: int = 1
    tp: int = 1
    cp: int = 1
    world_size: int | None = None
    suggest: bool = False
    tokens_per_expert: Path | None = None
    json: bool = False
    hardware: str | None = None
    hardware_file: Path | None = None
    dtype: str | None = None
    reserve_gb: float = 0.0
    calibrate: bool = False
    out: Path | None = None
    non_expert: str | None = None  # replicate | fully_shard: cost the whole model's data parallelism


def _hardware(args: CostArgs):
    from .hardware import load_hardware

    try:
        return load_hardware(args.hardware, args.hardware_file)
    except (ValueError, TypeError, OSError) as e:
        raise UserError(f"hardware: {e}") from e


def _calibrate(args: CostArgs) -> int:
    from .calibration import calibrate

    cal = calibrate()
    out = args.out or Path("hp-rewrite-hardware.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cal.hardware.to_json())
    h = cal.hardware
    console.print(
        f"matmul: {h.flops_per_s / 1e9:.3g} GFLOP/s per rank; all-to-all: alpha {h.alpha_s * 1e6:.3g} us, "
        f"beta {h.beta_Bps / 1e9:.3g} GB/s ({len(cal.points)} sizes); wrote {out} "
        "(use it with --hardware-file)"
    )
    return 0


def cost(args: CostArgs) -> int:
    from ..plan import load_plan
    from .per_rank import Knobs, Parallel, Precision, Workload, estimate
    from .ranking import suggest
    from .report import cost_table, memory_lines, suggest_table, time_line
    from .routing import Histograms
    from .spec import model_spec
    from .timing import step_time

    if args.calibrate:
        return _calibrate(args)
    if args.plan is None or args.model_dir is None:
        raise UserError("cost needs PLAN and MODEL_DIR (or --calibrate alone)")
    if not args.seq_len or not args.micro_batch or args.seq_len < 1 or args.micro_batch < 1:
        raise UserError("cost needs --seq-len S and --micro-batch B (positive integers)")
    plan = load_plan(args.plan)
    config = load_config(args.model_dir)
    spec = model_spec(meta_model(config), config, plan)
    if not spec.layers:
        raise UserError(
            f"{args.model_dir}: no MoE layer selected by the plan (found none, or all excluded/unmatched)"
        )
    try:
        par = Parallel(ep=args.ep or plan.ep_size, etp=args.etp, tp=args.tp, cp=args.cp)
    except ValueError as e:
        raise UserError(str(e)) from e
    bad = sorted({lay.num_experts for lay in spec.layers if lay.num_experts % par.ep})
    if bad:
        raise UserError(
            f"ep {par.ep} does not divide the {bad[0]} experts of a MoE layer: choose an ep that divides it"
        )
    hw = _hardware(args)
    dtype_bytes = _DTYPES[args.dtype] if args.dtype else (spec.dtype_bytes or 2)
    prec, knobs, work = (
        Precision.of(dtype_bytes),
        Knobs.from_plan(plan),
        Workload(args.seq_len, args.micro_batch),
    )
    try:
        hist = Histograms.from_json(args.tokens_per_expert) if args.tokens_per_expert else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--tokens-per-expert {args.tokens_per_expert}: {e}") from e
    result = estimate(spec, par, work, prec, knobs, hist)
    st = step_time(result, hw)
    reserve = args.reserve_gb * 1e9
    cands = []
    if args.non_expert is not None and not args.suggest:
        raise UserError("--non-expert replicate|fully_shard goes with --suggest --world-size W")
    if args.suggest:
        if not args.world_size:
            raise UserError("--suggest needs --world-size W (the ranks to split into EP x DP)")
        cands = suggest(spec, args.world_size, work, hw, par, prec, knobs, hist, reserve, args.non_expert)
        if not cands:
            raise UserError(f"no ep divides both the world size {args.world_size} and the experts")
    if args.json:
        doc = {
            "spec": {
                "model_type": spec.model_type,
                "moe_layers": len(spec.layers),
                "notes": list(spec.notes),
                "excluded": list(spec.excluded),
                "unmatched": list(spec.unmatched),
                "archetypes": sorted({json.dumps(lay.archetype, sort_keys=True) for lay in spec.layers}),
                "confirmed": sorted({lay.confirmed for lay in spec.layers}),
            },
            "hardware": json.loads(hw.to_json()),
            "cost": result.as_dict(),
            "time": {
                "total_s": st.total,
                "compute_s": st.compute,
                "comm_s": st.comm,
                "exposed_comm_s": st.exposed_comm,
            },
            "suggest": [
                {
                    "ep": c.ep,
                    "feasible": c.feasible,
                    "reason": c.reason,
                    "step_s": c.time.total,
                    "compute_s": c.time.compute,
                    "comm_s": c.time.comm,
                    "exposed_comm_s": c.time.exposed_comm,
                    "memory_bytes": c.memory_bytes,
                    "max_imbalance": c.cost.max_imbalance,
                    "bound": c.bound,
                    **({} if c.data_parallel is None else {
                        "non_expert": c.data_parallel.mode,
                        "state_bytes": c.data_parallel.state_bytes,
                        "dp_comm_bytes": c.data_parallel.comm_bytes,
                        "dp_comm_s": c.data_parallel.comm_s,
                        "dp_exposed_s": c.dp_exposed_s,
                    }),
                }
                for c in cands
            ],
        }
        print(json.dumps(doc, indent=2))
        return 0
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
    for line in memory_lines(result, hw, reserve) + [time_line(st, hw)]:
        console.print(line, highlight=False)
    if cands:
        console.print(suggest_table(cands, args.world_size, hw))
    return 0


def _read_token_file(path: Path) -> list[list[int]]:
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        if isinstance(data, dict):
            data = data.get("input_ids", data.get("tokens"))
        if isinstance(data, list) and data and all(isinstance(x, int) for x in data):
            data = [data]
    else:
        data = [
            [int(t) for t in line.replace(",", " ").split()] for line in text.splitlines() if line.strip()
        ]
    if not (
        isinstance(data, list)
        and data
        and all(isinstance(s, list) and s and all(isinstance(t, int) for t in s) for s in data)
    ):
        raise UserError(
            f"--tokens {path}: expected token ids: a JSON list (or list of lists, or "
            '{"input_ids": ...}), or a text file of integers, one sequence per line'
        )
    return data


def profile(
    plan_path: Path,
    model_dir: Path,
    tokens: Path | None,
    ep: int | None,
    out: Path | None,
    seq_len: int,
    batch: int,
    seed: int,
) -> int:
    import torch

    from ..loading.tiny import auto_class_for
    from ..plan import load_plan
    from .profile import record_routing, write_profile
    from .report import profile_table

    plan = load_plan(plan_path)
    config = load_config(model_dir)
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        raise UserError(
            f"{model_dir}: no weights (*.safetensors / *.bin); profile runs the model, cost needs "
            "only config.json"
        )
    ep = ep or plan.ep_size
    vocab = config.get_text_config(decoder=True).vocab_size
    if tokens is not None:
        seqs = _read_token_file(tokens)
        bad = [t for s in seqs for t in s if not 0 <= t < vocab]
        if bad:
            raise UserError(f"--tokens {tokens}: id {bad[0]} outside the vocabulary [0, {vocab})")
        lengths = {len(s) for s in seqs}
        batches = [torch.tensor(seqs)] if len(lengths) == 1 else [torch.tensor([s]) for s in seqs]
    else:
        gen = torch.Generator().manual_seed(seed)
        batches = [torch.randint(0, vocab, (batch, seq_len), generator=gen)]
    model = auto_class_for(config).from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    )
    model.eval()
    prof = record_routing(model, batches, plan)
    if not prof.layers:
        raise UserError(f"{model_dir}: no MoE layer selected by the plan")
    bad = sorted({len(lay.tokens_per_expert) for lay in prof.layers if len(lay.tokens_per_expert) % ep})
    if bad:
        raise UserError(f"--ep {ep} does not divide the {bad[0]} experts: choose an ep that divides it")
    js, png = write_profile(prof, ep, Path(out or "hp-rewrite-profile"))
    console.print(profile_table(prof, ep))
    console.print(f"wrote {js} and {png}")
    console.print(
        f"to place experts by this load, add to the plan:  placement: {{strategy: balanced, profile: {js.resolve()}}}",
        highlight=False,
    )
    return 0
