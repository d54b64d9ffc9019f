"""EP=2 as two processes on one device, for tools/device_check.py (section c).

NCCL refuses two ranks on one GPU; gloo over CUDA tensors stages each all-to-all through the host but
runs every CUDA code path of the exchange, the dispatch and the local experts. Each rank:

* qwen3_moe and deepseek_v3 (tiny, bf16 on an accelerator) rewritten at EP=2 against the unmodified
  model on the whole batch: logits and every gradient (bf16 tolerance), twice (bitwise repeatability of
  logits and gradients), and the host synchronisations of each MoE layer's forward and of the whole
  backward (``torch.cuda.set_sync_debug_mode("warn")``: every synchronising call warns; on CPU nothing
  synchronises and the counts are None);
* single-token decode (one token per rank: local experts without rows, a rank receiving nothing);
* context parallelism (``cp_size: 2``, Ulysses) with the EP group over both ranks: one sequence split in
  two, against the unmodified model on it, and the host synchronisations of each attention's forward;
* with ``speed``, one Qwen3-30B-A3B-shaped layer's local experts at EP=2 (64 of 128 experts per rank)
  timed against transformers' grouped_mm over all 128 experts on the same tokens.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

BF16_TOL = 3e-2


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize()


class _Syncs:
    """Counts the synchronising calls CUDA reports while active (None where the device cannot say)."""

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self.records: list = []

    def __enter__(self) -> _Syncs:
        if self.on:
            self._catch = warnings.catch_warnings(record=True)
            self.records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)

    def count(self) -> int | None:
        return sum("synchroniz" in str(w.message) for w in self.records) if self.on else None


def _model_case(model_type: str, device: torch.device, dtype: torch.dtype, tokens: int, runtime: str = "") -> dict:
    import torch.distributed as dist

    from hp_rewrite.plan import parse_plan
    from hp_rewrite.rewrite import generate, install
    from hp_rewrite.runtime.group.groups import build_expert_parallel_group
    from hp_rewrite.tiny import build_tiny_model, tiny_config
    from hp_rewrite.verify import gradient_errors

    rank, world = dist.get_rank(), dist.get_world_size()
    plan = parse_plan(f"version: 1\nep_size: {world}\n{runtime}")
    ep = build_expert_parallel_group(world)
    ref = build_tiny_model(tiny_config(model_type), seed=0).to(device=device, dtype=dtype)
    model = copy.deepcopy(ref)
    with tempfile.TemporaryDirectory() as out:
        _, artifact = generate(model, plan, model.config, Path(out))
        blocks = [model.get_submodule(p) for p in install(model, artifact, plan, ep)]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (world, tokens), generator=gen).to(device)
    upstream = torch.randn((world, tokens, model.config.vocab_size), generator=gen).to(device=device, dtype=dtype)
    (ref(input_ids=ids).logits * upstream).sum().backward()
    syncs = _Syncs(device)
    marks: list[int | None] = []
    for b in blocks:
        b.register_forward_pre_hook(lambda *_: marks.append(syncs.count()))
        b.register_forward_hook(lambda *_: marks.append(syncs.count()))
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        marks.clear()
        with syncs:
            logits = model(input_ids=ids[rank : rank + 1]).logits
            forward_marks = list(marks)
            before_backward = syncs.count()
            (logits * upstream[rank : rank + 1]).sum().backward()
            backward = None if before_backward is None else syncs.count() - before_backward
        _sync(device)
        runs.append((logits.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None}, forward_marks, backward))
    (first_logits, first_grads, marks_fwd, backward_syncs), (second_logits, second_grads, _, _) = runs
    errors = {n: rel for n, (_, rel) in gradient_errors(model, ref, ep, world).items()}
    ref_logits = ref(input_ids=ids[rank : rank + 1]).logits.detach()
    errors["logits"] = ((first_logits - ref_logits).float().abs().max() / ref_logits.float().abs().max()).item()
    worst = max(errors, key=errors.get)
    per_layer = (None if marks_fwd[0] is None
                 else [marks_fwd[i + 1] - marks_fwd[i] for i in range(0, len(marks_fwd), 2)])
    return {"worst": worst, "worst_rel": errors[worst], "tolerance": BF16_TOL,
            "passed": errors[worst] <= BF16_TOL,
            "bitwise_repeatable": bool(torch.equal(first_logits, second_logits) and first_grads.keys() == second_grads.keys()
                                       and all(torch.equal(first_grads[n], second_grads[n]) for n in first_grads)),
            "forward_syncs_per_moe_layer": per_layer, "backward_syncs": backward_syncs}


def _context_case(device: torch.device, dtype: torch.dtype, tokens: int = 32) -> dict:
    """qwen3_moe at EP=2 with ``cp_size: 2`` (Ulysses): both ranks hold one sequence, each runs its half
    through the decoder layers (attention on half the heads of the whole sequence), the logits gathered
    whole. Against the unmodified model on that sequence: logits and every gradient after the gradient
    contract; the host synchronisations of the attention modules' forwards and of the whole backward."""
    import torch.distributed as dist

    from hp_rewrite.loading.patch import rewrite_model
    from hp_rewrite.loading.record import record_of
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.tiny import build_tiny_model, tiny_config
    from hp_rewrite.verify import gradient_errors

    world = dist.get_world_size()
    ref = build_tiny_model(tiny_config("qwen3_moe"), seed=0).to(device=device, dtype=dtype)
    with tempfile.TemporaryDirectory() as out:
        model = rewrite_model(copy.deepcopy(ref), parse_plan(f"version: 1\nep_size: {world}\ncp_size: {world}\n"),
                              artifact_dir=Path(out))
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, ref.config.vocab_size, (1, tokens), generator=gen).to(device)
    upstream = torch.randn((1, tokens, ref.config.vocab_size), generator=gen).to(device=device, dtype=dtype)
    ref_logits = ref(input_ids=ids).logits
    (ref_logits * upstream).sum().backward()
    syncs, marks = _Syncs(device), []
    for m in record_of(model).context.attention:
        m.register_forward_pre_hook(lambda *_: marks.append(syncs.count()))
        m.register_forward_hook(lambda *_: marks.append(syncs.count()))
    with syncs:
        logits = model(input_ids=ids).logits
        before_backward = syncs.count()
        (logits * upstream).sum().backward()
        backward = None if before_backward is None else syncs.count() - before_backward
    _sync(device)
    errors = {n: rel for n, (_, rel) in gradient_errors(model, ref, record_of(model).ep, world).items()}
    errors["logits"] = ((logits - ref_logits).float().abs().max() / ref_logits.float().abs().max()).item()
    worst = max(errors, key=errors.get)
    per_attention = None if not marks or marks[0] is None else [marks[i + 1] - marks[i] for i in range(0, len(marks), 2)]
    return {"worst": worst, "worst_rel": errors[worst], "tolerance": BF16_TOL, "passed": errors[worst] <= BF16_TOL,
            "bitwise_repeatable": None, "forward_syncs_per_moe_layer": per_attention, "backward_syncs": backward}


def _decode_case(device: torch.device, dtype: torch.dtype) -> dict:
    """One token per rank through a tiny EP=2 qwen3_moe: some local experts and maybe a whole rank get no row."""
    result = _model_case("qwen3_moe", device, dtype, tokens=1)
    return {k: result[k] for k in ("worst", "worst_rel", "tolerance", "passed", "bitwise_repeatable")}


def _layer_speed(device: torch.device, dtype: torch.dtype, size: dict, iters: int) -> dict:
    """Local experts of one layer at EP=2 (this rank's half of the experts, its share of the routed
    tokens after the exchange) against transformers' grouped_mm over all experts on the same tokens."""
    import torch.distributed as dist
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hp_rewrite.runtime.binding.install import install_expert_parallel
    from hp_rewrite.runtime.group.groups import build_expert_parallel_group
    from hp_rewrite.runtime.options import RuntimeOptions
    from hp_rewrite.runtime.pipeline.dispatch import moe_forward
    from hp_rewrite.runtime.pipeline.layer import ExpertParallelBinding

    T, H, inter, E, K = (size[k] for k in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    world = dist.get_world_size()
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "grouped_mm"
    full = Qwen3MoeExperts(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        full.gate_up_proj.normal_(std=0.02)
        full.down_proj.normal_(std=0.02)
    local = copy.deepcopy(full)
    ep = build_expert_parallel_group(world)
    install_expert_parallel(local, num_experts=E, ep=ep, options=RuntimeOptions())
    gen = torch.Generator().manual_seed(dist.get_rank())
    hidden = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    top_w, indices = torch.randn(T, E, generator=gen).softmax(-1).topk(K, dim=-1)
    weights = top_w.to(device=device, dtype=dtype).requires_grad_()
    indices = indices.to(device)
    grad = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    binding = ExpertParallelBinding.for_experts(E, ep, RuntimeOptions())
    steps = {"hp-ep2": lambda: moe_forward(hidden, indices, weights, local, binding=binding).backward(grad),
             "hf-grouped-all-experts": lambda: full(hidden, indices, weights).backward(grad)}
    times: dict[str, list[float]] = {n: [] for n in steps}
    for it in range(iters + 1):
        for name, step in steps.items():
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            if it:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(ts) for n, ts in times.items()}
    return {n: {"median_s": t, "tokens_per_s": T / t, "speed_vs_hf": med["hf-grouped-all-experts"] / t}
            for n, t in med.items()}


def worker(rank: int, world: int, payload: dict) -> dict:
    device = torch.device(payload["device"], 0) if payload["device"] != "cpu" else torch.device("cpu")
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
    else:
        torch.set_num_threads(1)
    dtype = getattr(torch, payload["dtype"])
    out = {m: _model_case(m, device, dtype, tokens=16) for m in ("qwen3_moe", "deepseek_v3")}
    out["decode-1-token"] = _decode_case(device, dtype)
    # runtime.balance forced on (any imbalance, any piece): lent weights through the device's GEMMs, one host read
    out["qwen3_moe-balanced"] = _model_case("qwen3_moe", device, dtype, tokens=16, runtime=(
        "runtime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1}\n"))
    # context parallelism (cp_size 2, Ulysses) over the same two ranks; its sync column counts per attention
    out["qwen3_moe-cp2-ulysses"] = _context_case(device, dtype)
    if payload.get("speed"):
        out["layer_speed"] = _layer_speed(device, dtype, payload["size"], payload["iters"])
    return out
