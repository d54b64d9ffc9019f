"""Measurements for the cost-model checks, run on every rank of a real gloo world (or in-process at EP=1).

For each family: the tiny model is rewritten for the EP group, then every MoE block is run directly
(forward and backward) on this rank's random input under FlopCounterMode (with the grouped-GEMM
formula of :mod:`hp_rewrite.cost.flopcount`). The runtime's ``DispatchStats`` of each call are
recorded by wrapping ``hp_rewrite.runtime.dispatch`` (block-level generated code calls it through
the module, so the wrapper sees every call), and the global tokens-per-expert histogram is the sum
over the EP group of each rank's ``tokens_per_expert``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import hp_rewrite.runtime as hp
from hp_rewrite.cost.flopcount import count_flops
from hp_rewrite.match.structure import find_blocks
from hp_rewrite.plan import parse_plan
from hp_rewrite.rewrite import generate, install
from hp_rewrite.runtime.binding.install import install_expert_parallel
from hp_rewrite.runtime.group.groups import ExpertParallelGroup, build_expert_parallel_group
from hp_rewrite.runtime.options import RuntimeOptions
from hp_rewrite.tiny import build_tiny_model, tiny_config

FAMILIES = ("qwen3_moe", "qwen2_moe", "deepseek_v3")
SEQ, BATCH = 8, 2


def measure(
    model_type: str, out_dir: str, rank: int = 0, world: int = 1, compute: str = "grouped", dedup: bool = False
) -> list[dict]:
    """``dedup`` off by default: the plain exchange's rows and bytes are what the cost model counts exactly."""
    text = f"version: 1\nep_size: {world}\nruntime:\n  compute: {compute}\n  dedup: {str(dedup).lower()}\n"
    plan = parse_plan(text)
    ep = build_expert_parallel_group(world) if world > 1 else ExpertParallelGroup.single()
    model = build_tiny_model(tiny_config(model_type), seed=0)
    _, artifact = generate(model, plan, model.config, Path(out_dir) / f"rank{rank}")
    install(model, artifact, plan, ep)
    recorded: list = []
    original = hp.dispatch

    def recording(*args, **kwargs):
        state = original(*args, **kwargs)
        recorded.append(state.stats)
        return state

    results = []
    hp.dispatch = recording
    try:
        for s in find_blocks(model):
            gen = torch.Generator().manual_seed(100 + rank)
            x = torch.randn(BATCH, SEQ, s.hidden_size, generator=gen, requires_grad=True)
            upstream = torch.randn(BATCH, SEQ, s.hidden_size, generator=gen)

            def step(block=s.block, x=x, upstream=upstream):
                out = block(x)
                out = out[0] if isinstance(out, tuple) else out
                (out * upstream).sum().backward()

            recorded.clear()
            flops = count_flops(step)
            (stats,) = recorded
            hist = stats.tokens_per_expert.clone()
            if world > 1:
                dist.all_reduce(hist)
            results.append(
                {
                    "path": s.path,
                    "flops": flops,
                    "tokens_per_expert": hist.tolist(),
                    "rows_sent": stats.rows_sent,
                    "rows_received": stats.rows_received,
                    "bytes_sent": stats.bytes_sent,
                    "bytes_received": stats.bytes_received,
                }
            )
    finally:
        hp.dispatch = original
    return results


def uniform_dedup_rows(rank: int, world: int, tokens: int, num_experts: int, top_k: int) -> dict:
    """Rows the dedup exchange moves when every token picks ``top_k`` distinct experts uniformly at random
    (the case the cost model's estimate is exact for, in expectation)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    ep = build_expert_parallel_group(world)
    config = Qwen3MoeConfig(hidden_size=4, moe_intermediate_size=4, num_experts=num_experts, num_experts_per_tok=top_k)
    experts = Qwen3MoeExperts(config)
    install_expert_parallel(experts, num_experts=num_experts, ep=ep, options=RuntimeOptions(dedup=True))
    gen = torch.Generator().manual_seed(rank)
    indices = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.full((tokens, top_k), 1.0 / top_k)
    state = hp.dispatch(torch.randn(tokens, 4, generator=gen), indices, weights, binding=hp.binding_of(experts))
    hp.experts_and_combine(state, experts)
    return {"rows_sent": state.stats.rows_sent, "rows_received": state.stats.rows_received}


def run_cost_world(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    out = {
        f"{mt}/{compute}": measure(mt, payload["out_dir"], rank, world, compute)
        for mt in payload["families"]
        for compute in payload["computes"]
    }
    for mt in payload["families"]:
        out[f"{mt}/dedup"] = measure(mt, payload["out_dir"], rank, world, "grouped", dedup=True)
    out["uniform"] = uniform_dedup_rows(rank, world, 4096, 16, 4)
    return out
