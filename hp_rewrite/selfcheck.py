"""``hp-rewrite selfcheck``: a tiny transformers MoE model, expert-parallel on N local ranks, checked
against the unmodified model (logits and every parameter gradient).

Every experts holder that follows the transformers experts contract is made expert-parallel in
place (the model's own router and shared-expert code keep running), so this exercises the routed
runtime end to end on a real model built from its config. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn

from .runtime import (
    ExpertParallelError,
    ExpertsLayout,
    RuntimeOptions,
    build_expert_parallel_group,
    install_expert_parallel,
)

# Shrunk sizes per model type: small enough for a CPU, every MoE code path still present.
_COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
TINY = {
    "qwen3_moe": {
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "head_dim": 16,
    },
    "qwen2_moe": {
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "mixtral": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    "olmoe": {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
    "deepseek_v3": {
        "moe_intermediate_size": 32,
        "intermediate_size": 96,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "n_shared_experts": 1,
        "num_key_value_heads": 4,
    },
    "gpt_oss": {
        "intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
DEFAULT_MODEL_TYPE = "qwen3_moe"
FP32_TOL = 1e-5


def tiny_model(model_type: str, seed: int = 0) -> nn.Module:
    """A random-weight causal LM of ``model_type`` with the :data:`TINY` sizes (fp32, eager experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in TINY:
        raise ExpertParallelError(f"model type {model_type!r}: selfcheck knows {', '.join(sorted(TINY))}")
    config = AutoConfig.for_model(model_type, **{**_COMMON, **TINY[model_type]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # routers and biases start at zero: randomise so routing is non-trivial
        for name, p in model.named_parameters():
            if p.abs().max() == 0 or name.endswith("gate.weight") or "router" in name:
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if "correction_bias" in name:
                b.normal_(0.0, 0.05)
    return model


def experts_holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that hold per-expert 3-D weights and expose ``num_experts`` (found by structure)."""
    found = []
    for name, module in model.named_modules():
        n = getattr(module, "num_experts", None)
        if not isinstance(n, int):
            continue
        try:
            layout = ExpertsLayout.of(module)
        except ExpertParallelError:
            continue
        weights = [getattr(module, w) for w in layout.weight_names]
        if all(w.dim() >= 2 and w.shape[0] == n for w in weights):
            found.append((name, module))
    return found


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if b.numel() else 0.0


def run_rank(rank: int, world: int, payload: dict) -> dict:
    """One rank: reference model on the global batch, EP model on this rank's share, compare."""
    torch.set_num_threads(1)
    ep = build_expert_parallel_group(payload["ep_size"])
    options = RuntimeOptions(**payload.get("options", {}))
    ref = tiny_model(payload["model_type"])
    model = copy.deepcopy(ref)
    holders = experts_holders(model)
    if not holders:
        raise ExpertParallelError(f"{payload['model_type']}: no experts holder found")
    expert_params = set()
    for name, module in holders:
        install_expert_parallel(module, num_experts=module.num_experts, ep=ep, options=options)
        expert_params |= {f"{name}.{w}" for w in module.hp_layout.weight_names}

    per_rank, seq = payload["batch_per_rank"], payload["seq_len"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.config.vocab_size, (per_rank * world, seq), generator=gen)
    upstream = torch.randn(per_rank * world, seq, ref.config.vocab_size, generator=gen)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)

    t0 = time.perf_counter()
    ref_logits = ref(input_ids=ids).logits
    (ref_logits * upstream).sum().backward()
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits = model(input_ids=ids[mine]).logits
    (logits * upstream[mine]).sum().backward()
    t_ep = time.perf_counter() - t0

    ref_params = dict(ref.named_parameters())
    worst_grad, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        ref_grad = ref_params[name].grad
        if name in expert_params:
            if ep.replica_group is not None:
                dist.all_reduce(grad, group=ep.replica_group)
            module = model.get_submodule(name.rsplit(".", 1)[0])
            ref_grad = ref_grad[module.hp_expert_parallel.placement.local_slice]
        else:
            dist.all_reduce(grad)
        err = _rel(grad, torch.zeros_like(grad) if ref_grad is None else ref_grad)
        if err > worst_grad:
            worst_grad, worst_name = err, name
    return {
        "holders": [
            f"{n} ({type(m).__name__}, {m.hp_expert_parallel.placement.num_local} of "
            f"{m.hp_expert_parallel.num_experts} experts local)"
            for n, m in holders
        ],
        "logits_rel_err": _rel(logits.detach(), ref_logits.detach()[mine]),
        "grad_rel_err": worst_grad,
        "worst_grad": worst_name,
        "ref_seconds": t_ref,
        "ep_seconds": t_ep,
    }
