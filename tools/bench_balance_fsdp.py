"""Balancing benchmark under FSDP2 (``runtime.balance: auto`` with ``hp_rewrite.fully_shard``): the whole
training step (forward + backward + SGD step) of a rewritten Qwen3-MoE model with skewed routing, balancing
off and ``auto`` paired in one run, at EP 4 on 4 gloo ranks (experts over an expert-replica mesh of 1,
the rest sharded over 4) and on 8 ranks (2 expert replicas: the experts sharded too). CPU, fp32, one
thread per rank.

The model: ``tiny_config("qwen3_moe")`` enlarged so that the experts' GEMMs dominate (``--hidden``,
``--intermediate``, ``--experts``, top-2, 2 layers, vocabulary 128), rewritten with ``version: 1 /
ep_size: 4`` plus ``runtime: {balance: auto}`` or ``{balance: off}``, both from the same weights in the
same world, each ``hp_rewrite.fully_shard``-ed (its default mesh). The skew: every token's router input
shares a common direction (its mean over the batch), so adding ``alpha`` times it to the router rows of
EP rank 0's experts raises their logits for (nearly) every token; ``alpha`` is set per layer, on the
unmodified model and the world's whole batch, so that rank 0 gets ``--skew`` times the mean rows.

The method is tools/bench_balance.py's (its summary, its glibc malloc settings, ``balance_min_rows`` from
the ``--hardware`` preset, ``balance_threshold`` 1.1): every iteration runs both variants, order
alternating, each step between barriers; per step each rank records its wall time and its main thread's
CPU time, the step's time is the slower rank's, and the figures are the medians over the iterations of
the ratios balanced / not. With more ranks than cores the wall time is the machine's total work: read
the busiest rank's CPU ratio there. Rows per rank (placed -> computed) are the EP group's sums of
``last_stats(holder).rank_rows``, per layer; the losses of both variants are compared every iteration.

Run (from the repo root, virtualenv active)::

    python tools/bench_balance_fsdp.py                     # 4 and 8 ranks, 10 timed iterations
    python tools/bench_balance_fsdp.py --worlds 4 --iters 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hp_rewrite
from hp_rewrite.cost.balance import break_even_rows
from hp_rewrite.cost.hardware import PRESETS
from hp_rewrite.launch import run_world
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.options import RuntimeOptions
from hp_rewrite.tiny import build_tiny_model, tiny_config

EP = 4


def _model(args):
    config = tiny_config("qwen3_moe")
    config.hidden_size, config.moe_intermediate_size, config.intermediate_size = args.hidden, args.intermediate, 1024
    config.num_experts, config.num_experts_per_tok, config.num_hidden_layers = args.experts, 2, 2
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 2, args.hidden // 8
    return build_tiny_model(config, seed=0).train()


def _batch(args, world: int) -> torch.Tensor:
    return torch.randint(0, 128, (world * args.batch, args.seq), generator=torch.Generator().manual_seed(7))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def skew_router(model, biases) -> None:
    """Add each layer's bias to the router rows of EP rank 0's experts (in place)."""
    with torch.no_grad():
        for layer, bias in zip(model.model.layers, biases, strict=True):
            layer.mlp.gate.weight[: layer.mlp.gate.weight.shape[0] // EP] += torch.tensor(bias)


def _rank0_share(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> float:
    """The share of top-2 slots that go to EP rank 0's experts with ``bias`` added to their router rows."""
    local = weight.shape[0] // EP
    logits = h @ weight.T + (h @ bias)[:, None] * (torch.arange(weight.shape[0]) < local)
    return (logits.topk(2, dim=-1).indices < local).float().mean().item()


def calibrate(args, world: int) -> list[list[float]]:
    """Per layer, ``alpha`` times the router input's mean direction such that rank 0's experts get
    ``skew / ep`` of the slots of the world's whole batch (bisection; earlier layers already skewed)."""
    model, ids, biases, seen = _model(args), _batch(args, world), [], []
    for layer in model.model.layers:
        hook = layer.mlp.gate.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach()))
        with torch.no_grad():
            model(input_ids=ids)
        hook.remove()
        h, weight = seen.pop().reshape(-1, args.hidden), layer.mlp.gate.weight.detach()
        mean = h.mean(0) / h.mean(0).norm()
        lo, hi = -16.0, 16.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _rank0_share(h, weight, mid * mean) < args.skew / EP else (lo, mid)
        biases.append((hi * mean).tolist())
        with torch.no_grad():  # the next layer's input as the skewed model computes it
            weight[: args.experts // EP] += hi * mean
    return biases


def _loads(model, ep) -> tuple[list[list[float]], int]:
    """Per layer [placed, computed] max/mean rows per EP rank, and copies made over the EP group."""
    out, moved = [], 0
    for _, holder in installed.holders(model):
        stats = installed.last_stats(holder)
        rows, guests = stats.rank_rows.clone(), torch.tensor([stats.guests])
        dist.all_reduce(rows, group=ep.group)
        dist.all_reduce(guests, group=ep.group)
        out.append((rows.max(1).values * ep.size / rows.sum(1).clamp(min=1)).tolist())
        moved += int(guests)
    return out, moved


def run_rank(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    args = argparse.Namespace(**payload)
    ref = _model(args)
    skew_router(ref, args.biases)
    ids = _batch(args, world)[rank * args.batch : (rank + 1) * args.batch]  # the same batch every iteration
    runtime = {"off": "{balance: \"off\"}", "auto": f"{{balance: auto, balance_min_rows: {args.min_rows}}}"}
    models = {}
    for name in ("off", "auto"):
        plan = parse_plan(f"version: 1\nep_size: {EP}\nruntime: {runtime[name]}\n")
        model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(args.out_dir) / name)
        hp_rewrite.fully_shard(model)
        models[name] = (model, torch.optim.SGD(model.parameters(), lr=args.lr))
    ep = models["auto"][0].hp_rewrite.ep
    del ref
    records, first = [], None
    for it in range(args.warmup + args.iters):
        seen = {}
        for name in ("off", "auto") if it % 2 == 0 else ("auto", "off"):
            model, opt = models[name]
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            wall, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
            loss = _loss(model(input_ids=ids).logits, ids)
            loss.backward()
            opt.step()
            seen[name] = (time.perf_counter() - wall, time.thread_time() - cpu, loss.detach().reshape(1),
                          time.process_time() - proc)  # the last: every thread's, gloo's included
        losses = {n: seen[n][2].clone() for n in seen}
        for n in losses:
            dist.all_reduce(losses[n])  # the world's mean loss, up to the factor
        err = ((losses["auto"] - losses["off"]).abs() / losses["off"].abs()).item()
        first = err if first is None else first  # both models still hold the same weights
        loads, lent = _loads(models["auto"][0], ep)
        times = torch.tensor([[seen[n][0], seen[n][1], seen[n][3]] for n in ("off", "auto")])
        gathered = [torch.zeros_like(times) for _ in range(world)]
        dist.all_gather(gathered, times)
        slowest = torch.stack(gathered).max(0).values  # [variant, (wall, cpu, process cpu)]: the slower rank's
        total = torch.stack(gathered)[:, :, 2].sum(0)  # [variant]: every rank's process CPU, the machine's work
        if it >= args.warmup:
            records.append({"off": slowest[0].tolist(), "auto": slowest[1].tolist(), "layers": loads,
                            "before": max(b for b, _ in loads), "after": max(a for _, a in loads), "lent": lent,
                            "total_cpu": total.tolist(), "max_rel_err": err, "loss": (losses["off"] / world).item()})
    return {"records": records, "replicas": ep.replica_size, "first_loss_rel_diff": first}


def summary(records: list[dict]) -> dict:
    from tools.bench_balance import summary as paired  # the ratios and medians bench_balance reports

    out = paired({"skewed": records})["skewed"]
    out["layers"] = [[statistics.median(r["layers"][i][j] for r in records) for j in (0, 1)]
                     for i in range(len(records[0]["layers"]))]
    out["cpu_ms_off"] = 1e3 * statistics.median(r["off"][1] for r in records)
    out["total_cpu_ratio"] = statistics.median(r["total_cpu"][1] / r["total_cpu"][0] for r in records)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8], help="ranks (EP 4 x world / 4 replicas)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--skew", type=float, default=2.25, help="rank 0's rows / the mean rows per EP rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hardware", default="cpu-gloo", choices=sorted(PRESETS))
    parser.add_argument("--no-malloc-cache", action="store_true", help="leave glibc's malloc thresholds as they are")
    parser.add_argument("--out", type=Path, default=Path("bench-results/bench_balance_fsdp.json"))
    args = parser.parse_args()
    repo = str(Path(__file__).resolve().parent.parent)
    if repo not in sys.path:
        sys.path.insert(0, repo)  # the spawned ranks import tools.bench_balance_fsdp:run_rank from the repo root
    args.min_rows = max(1, round(break_even_rows(PRESETS[args.hardware], 4)))  # fp32 weights
    if not args.no_malloc_cache:  # read by the ranks' glibc when they start
        os.environ.update(MALLOC_MMAP_THRESHOLD_=str(2**32), MALLOC_TRIM_THRESHOLD_=str(2**32))
    assert RuntimeOptions().balance_threshold == 1.1
    results = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__, "min_rows": args.min_rows,
               "load_average_1_5_15min": os.getloadavg(), "sizes": {k: getattr(args, k) for k in (
                   "batch", "seq", "hidden", "intermediate", "experts", "skew", "lr", "iters", "warmup")}, "worlds": {}}
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            payload = {k: v for k, v in vars(args).items() if k not in ("out", "worlds", "no_malloc_cache")}
            payload.update(biases=calibrate(args, world), out_dir=tmp)
            start = time.perf_counter()
            per_rank = run_world(world, "tools.bench_balance_fsdp:run_rank", payload, timeout=3000)
        records = per_rank[0]["records"]
        s = summary(records)
        first_err = per_rank[0]["first_loss_rel_diff"]
        results["worlds"][world] = {"summary": s, "replicas": per_rank[0]["replicas"], "iterations": records,
                                    "first_loss_rel_diff": first_err,
                                    "seconds": time.perf_counter() - start}
        layers = ", ".join(f"L{i} {b:.2f} -> {a:.2f}" for i, (b, a) in enumerate(s["layers"]))
        print(f"{world} ranks (EP {EP} x {per_rank[0]['replicas']} replicas, min_rows {args.min_rows}): rows max/mean "
              f"{layers}; lent {s['lent_per_step']:.0f}/step; wall x{s['wall_ratio']:.3f} (off {s['wall_ms_off']:.0f} ms), "
              f"busiest rank's CPU x{s['cpu_ratio']:.3f} (off {s['cpu_ms_off']:.0f} ms), all ranks' "
              f"process CPU x{s['total_cpu_ratio']:.3f}; loss rel diff: first iteration "
              f"{first_err:.1e}, timed ones at most {s['max_rel_err']:.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
