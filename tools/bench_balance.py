"""Balancing benchmark (``runtime.balance``): one MoE layer's forward + backward with and without
balancing, paired in one run, at EP 2 and EP 4 over local gloo ranks (CPU, fp32, one thread per rank).

Why this shape: an EP step waits for its busiest rank, and balancing moves expert rows (and a copy of
their weights) from the busiest ranks to the idlest. What it can gain is in the experts' GEMMs, so the
benchmark times the routed part of a layer (dispatch, experts, combine, and the backward of all three)
on a Qwen3-MoE experts holder, with routing drawn from three distributions over the experts:

  even    every expert equally likely (top-k distinct experts per token);
  zipf    expert popularity 1 / rank^1.2 over a fixed random order of the experts;
  skewed  one rank's experts get ``--skew`` times the mean share of rows (max/mean rows per rank).

Each rank draws one batch per distribution; each iteration runs every distribution with balancing off
and ``auto`` (order alternating), each step between barriers. Per step each rank records its wall time and its main thread's CPU time; the step's
time is the slower rank's. Reported per EP and distribution: max/mean rows per rank before and after
balancing, the experts lent per step, and the median of the per-iteration ratios (balanced / not) of
the wall time and of the busiest rank's CPU time. With more ranks than cores (EP 4 on a 2-core
machine) the wall time is the machine's total work, which balancing does not change: read the CPU
ratio there, which is what one core per rank would show. The outputs and gradients of both variants
are compared every iteration (max relative error).

``balance_min_rows`` is the cost model's break-even for the ``--hardware`` preset (cpu-gloo: measured on
the development host), ``balance_threshold`` the default 1.1. The ranks' glibc keeps freed memory
(``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` 4 GiB; ``--no-malloc-cache``: not), as PyTorch's
caching allocator does on a GPU: otherwise every step page-faults its large temporaries afresh, a
CPU-only cost that grows with the tensors allocated (the lent weights and their gradients too).

Run (from the repo root, virtualenv active)::

    python tools/bench_balance.py                      # EP 2 and 4, 20 timed iterations
    python tools/bench_balance.py --ep 2 --iters 3     # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hp_rewrite.cost.balance import break_even_rows
from hp_rewrite.cost.hardware import PRESETS
from hp_rewrite.launch import run_world
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.binding.install import install_expert_parallel
from hp_rewrite.runtime.group.groups import build_expert_parallel_group
from hp_rewrite.runtime.options import RuntimeOptions
from hp_rewrite.runtime.pipeline.dispatch import moe_forward

DISTRIBUTIONS = ("even", "zipf", "skewed")


def _experts(args):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                            num_experts=args.experts, num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    experts = Qwen3MoeSparseMoeBlock(config).experts
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    return experts


def _routing(kind: str, args, ep: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, K]`` distinct experts per token and their softmax weights, drawn for this rank."""
    gen = torch.Generator().manual_seed(rank)
    e = args.experts
    if kind == "even":
        probs = torch.ones(e)
    elif kind == "zipf":
        order = torch.randperm(e, generator=torch.Generator().manual_seed(5))
        probs = torch.empty(e)
        probs[order] = 1.0 / torch.arange(1, e + 1, dtype=torch.float32) ** 1.2
    else:  # rank 0's experts take skew / ep of the rows
        local = e // ep
        probs = torch.full((e,), (1 - args.skew / ep) / (e - local))
        probs[:local] = args.skew / ep / local
    indices = torch.multinomial(probs.expand(args.tokens, e), args.top_k, replacement=False, generator=gen)
    weights = torch.softmax(torch.randn(args.tokens, args.top_k, generator=gen), dim=-1)
    return indices, weights


def _step(experts, x, indices, weights, binding, grad):
    x = x.detach().requires_grad_()
    w = weights.detach().requires_grad_()
    for p in experts.parameters():
        p.grad = None
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    out = moe_forward(x, indices, w, experts, binding=binding)
    (out * grad).sum().backward()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    grads = [out.detach(), x.grad, w.grad, *(p.grad for p in experts.parameters())]
    return wall, cpu, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if b.numel() else 0.0


def run_rank(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    args = argparse.Namespace(**payload)
    ep = build_expert_parallel_group(world)
    off = RuntimeOptions()
    auto = RuntimeOptions(balance="auto", balance_min_rows=args.min_rows, balance_replicas=args.replicas)
    holders = {}
    for name, options in (("off", off), ("auto", auto)):
        experts = _experts(args)
        install_expert_parallel(experts, num_experts=args.experts, ep=ep, options=options)
        holders[name] = (experts, installed.binding(experts))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    grad = torch.randn(args.tokens, args.hidden, generator=gen)
    records = {kind: [] for kind in DISTRIBUTIONS}
    routes = {kind: _routing(kind, args, world, rank) for kind in DISTRIBUTIONS}  # the same batch every iteration
    for it in range(args.warmup + args.iters):
        for kind in DISTRIBUTIONS:
            indices, weights = routes[kind]
            order = ("off", "auto") if it % 2 == 0 else ("auto", "off")
            seen = {}
            for name in order:
                experts, binding = holders[name]
                wall, cpu, grads = _step(experts, x, indices, weights, binding, grad)
                stats = installed.last_stats(experts)
                rows = stats.rank_rows.clone()
                dist.all_reduce(rows)
                seen[name] = (wall, cpu, grads, rows, stats.guests)
            err = max(_rel(a, b) for a, b in zip(seen["auto"][2], seen["off"][2], strict=True))
            times = torch.tensor([[seen[n][0], seen[n][1]] for n in ("off", "auto")])
            gathered = [torch.zeros_like(times) for _ in range(world)]
            dist.all_gather(gathered, times)
            slowest = torch.stack(gathered).max(0).values  # [variant, (wall, cpu)]: the slower rank's
            guests = torch.tensor([seen["auto"][4]])
            dist.all_reduce(guests)
            rows = seen["auto"][3]
            if it >= args.warmup:
                records[kind].append({"off": slowest[0].tolist(), "auto": slowest[1].tolist(),
                                      "before": (rows[0].max() * world / rows[0].sum()).item(),
                                      "after": (rows[1].max() * world / rows[1].sum()).item(),
                                      "lent": int(guests), "max_rel_err": err})
    return records


def summary(records: dict) -> dict:
    out = {}
    for kind, its in records.items():
        out[kind] = {
            "rank_imbalance": statistics.median(r["before"] for r in its),
            "rank_imbalance_balanced": statistics.median(r["after"] for r in its),
            "lent_per_step": statistics.median(r["lent"] for r in its),
            "wall_ratio": statistics.median(r["auto"][0] / r["off"][0] for r in its),
            "cpu_ratio": statistics.median(r["auto"][1] / r["off"][1] for r in its),
            "wall_ms_off": 1e3 * statistics.median(r["off"][0] for r in its),
            "max_rel_err": max(r["max_rel_err"] for r in its),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--skew", type=float, default=1.5, help="the skewed batch's max/mean rows per rank")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-malloc-cache", action="store_true", help="leave glibc's malloc thresholds as they are")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hardware", default="cpu-gloo", choices=sorted(PRESETS))
    parser.add_argument("--replicas", type=int, default=RuntimeOptions().balance_replicas,
                        help="runtime.balance_replicas (default: the runtime's)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/bench_balance.json"))
    args = parser.parse_args()
    repo = str(Path(__file__).resolve().parent.parent)
    if repo not in sys.path:
        sys.path.insert(0, repo)  # the spawned ranks import tools.bench_balance:run_rank from the repo root
    args.min_rows = max(1, round(break_even_rows(PRESETS[args.hardware], 4)))  # fp32 weights
    if not args.no_malloc_cache:  # read by the ranks' glibc when they start
        os.environ.update(MALLOC_MMAP_THRESHOLD_=str(2**32), MALLOC_TRIM_THRESHOLD_=str(2**32))
    results = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__, "min_rows": args.min_rows,
               "load_average_1_5_15min": os.getloadavg(), "malloc_cache": not args.no_malloc_cache,
               "sizes": {k: getattr(args, k) for k in ("tokens", "hidden", "intermediate", "experts", "top_k",
                                                         "skew", "iters", "replicas")}, "ep": {}}
    for ep in args.ep:
        payload = {k: v for k, v in vars(args).items() if k not in ("out", "ep", "no_malloc_cache")}
        per_rank = run_world(ep, "tools.bench_balance:run_rank", payload)
        results["ep"][ep] = {"summary": summary(per_rank[0]), "iterations": per_rank[0]}
        print(f"EP {ep} (min_rows {args.min_rows}):")
        for kind, s in results["ep"][ep]["summary"].items():
            print(f"  {kind:7s} rows max/mean {s['rank_imbalance']:.2f} -> {s['rank_imbalance_balanced']:.2f}, "
                  f"lent {s['lent_per_step']:.0f}/step, wall x{s['wall_ratio']:.3f} "
                  f"(off {s['wall_ms_off']:.1f} ms), busiest rank's CPU x{s['cpu_ratio']:.3f}, "
                  f"max rel err {s['max_rel_err']:.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
