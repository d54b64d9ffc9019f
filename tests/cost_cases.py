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
from hp_rewrite.loading.tiny import build_tiny_model, tiny_config
from hp_rewrite.match.structure import find_blocks
from hp_rewrite.plan import parse_plan
from hp_rewrite.rewrite import generate, install
from hp_rewrite.runtime import ExpertParallelGroup, build_expert_parallel_group

FAMILIES = ("qwen3_moe", "qwen2_moe", "deepseek_v3")
SEQ, BATCH = 8, 2


def measure(
    model_type: str, out_dir: str, rank: int = 0, world: int = 1, compute: str = "grouped"
) -> list[dict]:
    plan = parse_plan(f"version: 1\nep_size: {world}\nruntime:\n  compute: {compute}\n")
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


def run_cost_world(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    return {
        f"{mt}/{compute}": measure(mt, payload["out_dir"], rank, world, compute)
        for mt in payload["families"]
        for compute in payload["computes"]
    }
