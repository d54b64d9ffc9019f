"""The library behind ``hp-rewrite cost`` and ``hp-rewrite profile``.

:func:`estimate_cost` needs only ``config.json`` (the model is built on the meta device, nothing
allocated) and returns a :class:`CostReport`; :func:`profile_routing` runs the model on token ids, so
it needs the weights. Mistakes the user can fix raise :class:`~hp_rewrite.errors.UserError`; the
CLI renders the results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UserError
from ..hf import load_config, meta_model

_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class CostRequest:
    """What to cost: a plan and a checkpoint, the workload, the parallel degrees and the hardware."""

    plan: Path | None
    model_dir: Path | None
    seq_len: int | None
    micro_batch: int | None
    ep: int | None = None
    etp: int = 1
    tp: int | None = None  # None: the plan's tp_size
    cp: int | None = None  # None: the plan's cp_size
    world_size: int | None = None
    tp_sizes: tuple[int, ...] | None = None  # --suggest: the TP degrees to rank (default: tp only)
    cp_sizes: tuple[int, ...] | None = None  # --suggest: the context degrees to rank (default: cp only)
    suggest: bool = False
    tokens_per_expert: Path | None = None
    hardware: str | None = None
    hardware_file: Path | None = None
    dtype: str | None = None
    reserve_gb: float = 0.0
    non_expert: str | None = None  # replicate | fully_shard: cost the whole model's data parallelism
    trust_remote_code: bool = False  # build a remote-code model (its config.json auto_map)
    lora: int = 0  # > 0: a frozen base with LoRA of this rank on the routed experts
    keep_quantized: bool = False  # the routed experts held as the checkpoint's MXFP4 / FP8 codes (with --lora)
    colocated_vllm: float | None = None  # RL with vLLM on the same GPUs: its vllm_gpu_memory_utilization
    balance_skew: float | None = None  # runtime.balance: forecast a batch whose busiest rank gets this x the mean


@dataclass
class CostReport:
    spec: object  # spec.ModelSpec
    cost: object  # per_rank.ModelCost
    time: object  # timing.StepTime
    hardware: object  # hardware.Hardware
    candidates: list  # ranking.Candidate, with --suggest
    reserve_bytes: float
    load: object = None  # load.LoadBytes: what each rank reads from the checkpoint
    colocated: list | None = None  # colocated.MemoryLine: RL with vLLM on the same GPUs, per rank
    balance: object = None  # balance.BalanceForecast, with --balance-skew

    @property
    def colocated_total(self) -> float:
        return sum(line.bytes for line in self.colocated or ())

    def as_json(self) -> dict:
        spec, st = self.spec, self.time
        return {
            "spec": {
                "model_type": spec.model_type,
                "moe_layers": len(spec.layers),
                "notes": list(spec.notes),
                "excluded": list(spec.excluded),
                "unmatched": list(spec.unmatched),
                "archetypes": sorted({json.dumps(lay.archetype, sort_keys=True) for lay in spec.layers}),
                "confirmed": sorted({lay.confirmed for lay in spec.layers}),
            },
            "hardware": json.loads(self.hardware.to_json()),
            "cost": self.cost.as_dict(),
            "time": {"total_s": st.total, "compute_s": st.compute, "comm_s": st.comm,
                     "exposed_comm_s": st.exposed_comm},
            "suggest": [_candidate_json(c) for c in self.candidates],
            "load": self.load.as_dict() if self.load is not None else None,
            "colocated_rl": None if self.colocated is None else {
                "lines": [{"name": m.name, "bytes": m.bytes, "note": m.note} for m in self.colocated],
                "total_bytes": self.colocated_total, "capacity_bytes": self.hardware.memory_bytes},
            "balance": None if self.balance is None else {**vars(self.balance), "ratio": self.balance.ratio,
                                                          "pays": self.balance.pays,
                                                          "copy": self.balance.copy and vars(self.balance.copy)},
        }


def _candidate_json(c) -> dict:
    row = {"ep": c.ep, "tp": c.tp, "tokens_per_s": c.tokens_per_s, "feasible": c.feasible, "reason": c.reason,
           "step_s": c.time.total,
           "compute_s": c.time.compute, "comm_s": c.time.comm, "exposed_comm_s": c.time.exposed_comm,
           "memory_bytes": c.memory_bytes, "max_imbalance": c.cost.max_imbalance, "bound": c.bound}
    if c.data_parallel is not None:
        row.update({"non_expert": c.data_parallel.mode, "state_bytes": c.data_parallel.state_bytes,
                    "dp_comm_bytes": c.data_parallel.comm_bytes, "dp_comm_s": c.data_parallel.comm_s,
                    "dp_exposed_s": c.dp_exposed_s})
    return row


def load_hardware_for(preset: str | None, path: Path | None):
    from .hardware import load_hardware

    try:
        return load_hardware(preset, path)
    except (ValueError, TypeError, OSError) as e:
        raise UserError(f"hardware: {e}") from e


def calibrate_to(out: Path | None):
    """Measure this machine (2 local gloo ranks) and write the hardware JSON; returns (calibration, path)."""
    from .calibration import calibrate

    cal = calibrate()
    out = out or Path("hp-rewrite-hardware.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cal.hardware.to_json())
    return cal, out


def estimate_cost(req: CostRequest) -> CostReport:
    from ..plan import load_plan
    from .per_rank import Knobs, Parallel, Precision, Workload, estimate
    from .ranking import suggest
    from .routing import Histograms
    from .spec import model_spec
    from .timing import step_time

    if req.plan is None or req.model_dir is None:
        raise UserError("cost needs PLAN and MODEL_DIR (or --calibrate alone)")
    if not req.seq_len or not req.micro_batch or req.seq_len < 1 or req.micro_batch < 1:
        raise UserError("cost needs --seq-len S and --micro-batch B (positive integers)")
    plan = load_plan(req.plan)
    from ..loading.quantized import checkpoint_format
    from .load import load_bytes

    config = load_config(req.model_dir, req.trust_remote_code)
    fmt = checkpoint_format(getattr(config, "quantization_config", None), str(req.model_dir))  # readable, or refused
    kept = _kept_bytes(fmt, req)
    model = meta_model(config)
    spec = model_spec(model, config, plan)
    if not spec.layers:
        raise UserError(
            f"{req.model_dir}: no MoE layer selected by the plan (found none, or all excluded/unmatched)"
        )
    try:
        par = Parallel(ep=req.ep or plan.ep_size, etp=req.etp, tp=req.tp or plan.tp_size, cp=req.cp or plan.cp_size,
                       sequence_parallel=plan.sequence_parallel and (req.tp or plan.tp_size) > 1)
    except ValueError as e:
        raise UserError(str(e)) from e
    bad = sorted({lay.num_experts for lay in spec.layers if lay.num_experts % par.ep})
    if bad:
        raise UserError(
            f"ep {par.ep} does not divide the {bad[0]} experts of a MoE layer: choose an ep that divides it"
        )
    hw = load_hardware_for(req.hardware, req.hardware_file)
    dtype_bytes = _DTYPES[req.dtype] if req.dtype else (spec.dtype_bytes or 2)
    prec, knobs, work = Precision.of(dtype_bytes), Knobs.from_plan(plan), Workload(req.seq_len, req.micro_batch)
    if req.lora:
        prec = replace(prec, lora_rank=req.lora, expert_weight=kept)
    try:
        hist = Histograms.from_json(req.tokens_per_expert) if req.tokens_per_expert else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--tokens-per-expert {req.tokens_per_expert}: {e}") from e
    result = estimate(spec, par, work, prec, knobs, hist)
    reserve = req.reserve_gb * 1e9
    cands = []
    if req.lora and req.non_expert == "fully_shard":
        raise UserError("--lora with --non-expert fully_shard: FSDP2 over PEFT adapters on the experts is refused "
                        "(docs/training.md); use --non-expert replicate")
    if req.non_expert is not None and not (req.suggest or req.colocated_vllm is not None):
        raise UserError("--non-expert replicate|fully_shard goes with --suggest or --colocated-vllm, and --world-size W")
    colocated = _colocated(req, result, hw, config, spec) if req.colocated_vllm is not None else None
    if req.suggest:
        if not req.world_size:
            raise UserError("--suggest needs --world-size W (the ranks to split into EP x DP)")
        cands = suggest(spec, req.world_size, work, hw, par, prec, knobs, hist, reserve, req.non_expert,
                        req.tp_sizes, req.cp_sizes)
        if not cands:
            raise UserError(f"no ep (with a tp among {list(req.tp_sizes or (par.tp,))} and a cp among "
                            f"{list(req.cp_sizes or (par.cp,))}) divides both the world size {req.world_size} "
                            "and the experts")
    balance = _balance(req, plan, spec, par, work, hw, dtype_bytes, kept) if req.balance_skew is not None else None
    return CostReport(spec, result, step_time(result, hw), hw, cands, reserve, load_bytes(model, config, par.ep),
                      colocated, balance)


def _balance(req: CostRequest, plan, spec, par, work, hw, dtype_bytes: int, kept: float | None):
    """``runtime.balance`` on the first MoE layer for a batch of ``--balance-skew`` (:mod:`.balance`): the plan's
    knobs when it turns balancing on, else the defaults with the break-even rows of ``hw``. With ``--lora`` a
    lent expert sends its frozen weights (``--keep-quantized``: its codes and scales) and its factors."""
    from .balance import forecast
    from .per_rank import lora_params

    lay, knobs = spec.layers[0], plan.runtime
    on = knobs.balance == "auto"
    rows = work.seq_len * work.micro_batch * lay.top_k / (par.tp * par.cp)
    try:
        return forecast(ep=par.ep, num_experts=lay.num_experts, rows_per_rank=rows,
                        matmul_params=lay.routed.matmul_params, weight_bytes=kept or dtype_bytes, hw=hw,
                        skew=req.balance_skew, threshold=knobs.balance_threshold,
                        min_rows=knobs.balance_min_rows if on else None, replicas=knobs.balance_replicas,
                        lora_params=lora_params(lay.routed, req.lora) if req.lora else 0.0, factor_bytes=dtype_bytes)
    except ValueError as e:
        raise UserError(f"--balance-skew: {e}") from e


def _colocated(req: CostRequest, result, hw, config, spec) -> list:
    """The per-rank memory lines of RL with vLLM colocated (:mod:`.colocated`)."""
    from .colocated import colocated_rl_memory

    if not req.world_size:
        raise UserError("--colocated-vllm needs --world-size W (the training ranks, one GPU each)")
    text = config.get_text_config(decoder=True)
    try:
        return colocated_rl_memory(result, req.world_size, req.non_expert or "replicate", req.colocated_vllm,
                                   hw.memory_bytes, text.hidden_size, text.vocab_size,
                                   spec.num_hidden_layers or text.num_hidden_layers)
    except ValueError as e:
        raise UserError(f"--colocated-vllm: {e}") from e


def _kept_bytes(fmt, req: CostRequest) -> float | None:
    """Bytes per routed-expert value held with ``--keep-quantized`` (None without it)."""
    if req.lora < 0:
        raise UserError(f"--lora {req.lora}: the LoRA rank must be positive")
    if not req.keep_quantized:
        return None
    if fmt is None:
        raise UserError(f"--keep-quantized: {req.model_dir} is not an MXFP4 or block-FP8 checkpoint")
    if not req.lora:
        raise UserError("--keep-quantized: kept experts are frozen; cost the adapters trained on them with --lora R")
    if fmt.method == "mxfp4":
        return 0.5 + 1 / 32  # two E2M1 codes a byte, a scale byte per 32 values
    return 1 + 4 / (fmt.block[0] * fmt.block[1])  # a byte a value, an fp32 scale per block


def read_token_file(path: Path) -> list[list[int]]:
    """Token ids from a JSON list (or list of lists, or ``{"input_ids": ...}``) or a text file of integers."""
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        if isinstance(data, dict):
            data = data.get("input_ids", data.get("tokens"))
        if isinstance(data, list) and data and all(isinstance(x, int) for x in data):
            data = [data]
    else:
        data = [[int(t) for t in line.replace(",", " ").split()] for line in text.splitlines() if line.strip()]
    if not (isinstance(data, list) and data
            and all(isinstance(s, list) and s and all(isinstance(t, int) for t in s) for s in data)):
        raise UserError(
            f"--tokens {path}: expected token ids: a JSON list (or list of lists, or "
            '{"input_ids": ...}), or a text file of integers, one sequence per line'
        )
    return data


def profile_routing(plan_path: Path, model_dir: Path, tokens: Path | None, ep: int | None, out: Path | None,
                    seq_len: int, batch: int, seed: int, trust_remote_code: bool = False):
    """Run the model on token ids and record tokens per expert; returns (profile, ep, json path, png path)."""
    import torch

    from ..hf import auto_class_for
    from ..plan import load_plan
    from .profile import routing_profile, write_profile

    plan = load_plan(plan_path)
    config = load_config(model_dir, trust_remote_code)
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        raise UserError(
            f"{model_dir}: no weights (*.safetensors / *.bin); profile runs the model, cost needs "
            "only config.json"
        )
    ep = ep or plan.ep_size
    vocab = config.get_text_config(decoder=True).vocab_size
    if tokens is not None:
        seqs = read_token_file(tokens)
        bad = [t for s in seqs for t in s if not 0 <= t < vocab]
        if bad:
            raise UserError(f"--tokens {tokens}: id {bad[0]} outside the vocabulary [0, {vocab})")
        lengths = {len(s) for s in seqs}
        batches = [torch.tensor(seqs)] if len(lengths) == 1 else [torch.tensor([s]) for s in seqs]
    else:
        gen = torch.Generator().manual_seed(seed)
        batches = [torch.randint(0, vocab, (batch, seq_len), generator=gen)]
    model = auto_class_for(config).from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32,
                                                   trust_remote_code=trust_remote_code)
    model.eval()
    prof = routing_profile(model, batches, plan)
    if not prof.layers:
        raise UserError(f"{model_dir}: no MoE layer selected by the plan")
    bad = sorted({len(lay.tokens_per_expert) for lay in prof.layers if len(lay.tokens_per_expert) % ep})
    if bad:
        raise UserError(f"--ep {ep} does not divide the {bad[0]} experts: choose an ep that divides it")
    js, png = write_profile(prof, ep, Path(out or "hp-rewrite-profile"))
    return prof, ep, js, png


def profile_logged_routing(log: Path, ep: int | None, out: Path | None):
    """What :func:`profile_routing` returns, from a training run's routing log (every logged step summed)."""
    from .profile import from_routing_log, write_profile

    if not log.is_file():
        raise UserError(f"--routing-log {log}: no such file (a prepared Trainer writes it in its output_dir)")
    try:
        prof = from_routing_log(log)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--routing-log {log}: not a routing log written by hp-rewrite ({e})") from None
    if not prof.layers:
        raise UserError(f"--routing-log {log}: no logged step")
    ep = ep or 1
    bad = sorted({len(lay.tokens_per_expert) for lay in prof.layers if len(lay.tokens_per_expert) % ep})
    if bad:
        raise UserError(f"--ep {ep} does not divide the {bad[0]} experts: choose an ep that divides it")
    js, png = write_profile(prof, ep, Path(out or "hp-rewrite-profile"))
    return prof, ep, js, png
