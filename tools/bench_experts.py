"""Benchmark local MoE expert compute (forward + backward) on CPU, single process (EP=1).

Why: the hp-rewrite runtime must be faster than transformers' own ``grouped_mm`` experts path and close
to what the same FLOPs cost as one dense matmul chain. This script measures, in one run, on the same
weights and the same routing (random router logits -> softmax -> top-k):

  a. ``hp-grouped``   ``hp_rewrite.runtime.pipeline.dispatch.moe_forward`` with ``RuntimeOptions(compute="grouped")``
  b. ``hp-eager``     the same with ``compute="eager"`` (per-expert loop)
  c. ``hf-grouped``   transformers ``Qwen3MoeExperts`` with ``config._experts_implementation = "grouped_mm"``
  d. ``hf-eager``     the same module with ``_experts_implementation = "eager"``
  e. ``dense``        the ceiling: ``x[T*K, H] @ W1[H, 2I] -> SwiGLU -> [T*K, I] @ W2[I, H]``, no routing

Each iteration is a forward plus the backward of a fixed random upstream gradient (grads for the hidden
states, the routing weights and the expert parameters; set to None between iterations). Variants run
round-robin (a, b, c, d, e, a, b, ...) so machine noise hits them equally; the median of the timed
iterations is reported. Outputs and grads of a, b and d are checked against c after the first
iteration (max |x - ref| / max |ref| per tensor). FLOPs count the matmuls only: forward
``2*T*K*H*2I + 2*T*K*I*H``, backward twice that.

Run (from the repo root, virtualenv active)::

    python tools/bench_experts.py                       # T=4096 H=1024 I=512 E=32 K=4, 3 timed iters
    python tools/bench_experts.py --tokens 256 --hidden 128 --intermediate 64 --experts 8 --iters 2
    python tools/bench_experts.py --profile             # + torch.profiler top ops of hp-grouped, hf-grouped

Results go to ``--out`` (default ``bench-results/bench_experts.json``) as JSON. Timings include the page
faults of freshly allocated large tensors (glibc mmaps blocks over 32 MiB and returns them on free); to
see the cost without them, run with ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736``.
On a shared machine, check ``load_average_1_5_15min`` and the per-iteration ``times_s`` in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from rich.console import Console
from rich.table import Table
from transformers.integrations import moe as hf_moe
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hp_rewrite.runtime.group.groups import ExpertParallelGroup
from hp_rewrite.runtime.options import RuntimeOptions
from hp_rewrite.runtime.pipeline.dispatch import moe_forward
from hp_rewrite.runtime.pipeline.layer import ExpertParallelBinding

REFERENCE = "hf-grouped"
DENSE = "dense"
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLIBC_TUNABLES", "LD_PRELOAD")
Step = Callable[[], dict[str, torch.Tensor]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="T, tokens")
    p.add_argument("--hidden", type=int, default=1024, help="H, hidden size")
    p.add_argument("--intermediate", type=int, default=512, help="I, expert intermediate size")
    p.add_argument("--experts", type=int, default=32, help="E, number of experts")
    p.add_argument("--top-k", type=int, default=4, help="K, experts per token")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per variant (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per variant")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also profile one step of hp-grouped and hf-grouped")
    p.add_argument("--profile-rows", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("bench-results/bench_experts.json"))
    return p.parse_args(argv)


def build_steps(a: argparse.Namespace) -> dict[str, Step]:
    """One closure per variant; each runs forward + backward and returns the output and the grads."""
    T, H, inter, E, K = a.tokens, a.hidden, a.intermediate, a.experts, a.top_k
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=K)
    experts = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.02)
        experts.down_proj.normal_(std=0.02)
    params = [experts.gate_up_proj, experts.down_proj]

    hidden = torch.randn(T, H).requires_grad_()
    probs = torch.randn(T, E).softmax(dim=-1)
    top_w, indices = probs.topk(K, dim=-1)
    weights = top_w.detach().requires_grad_()  # routing weights: a leaf, so its grad is checked too
    grad_out = torch.randn(T, H)

    # Dense ceiling: same matmul FLOPs as the routed experts, no routing or grouping.
    x_dense = torch.randn(T * K, H).requires_grad_()
    w1 = (torch.randn(H, 2 * inter) * 0.02).requires_grad_()
    w2 = (torch.randn(inter, H) * 0.02).requires_grad_()
    grad_dense = torch.randn(T * K, H)

    def zero(*tensors: torch.Tensor) -> None:
        for t in tensors:
            t.grad = None

    def routed(forward: Callable[[], torch.Tensor]) -> Step:
        def step() -> dict[str, torch.Tensor]:
            zero(hidden, weights, *params)
            out = forward()
            out.backward(grad_out)
            return {"out": out.detach(), "hidden.grad": hidden.grad, "weights.grad": weights.grad,
                    "gate_up_proj.grad": params[0].grad, "down_proj.grad": params[1].grad}
        return step

    def hp(compute: str) -> Step:
        opts = RuntimeOptions(compute=compute)

        def forward() -> torch.Tensor:
            cfg._experts_implementation = "grouped_mm"  # transformers' default: runtime.compute decides
            return moe_forward(hidden, indices, weights, experts,
                               binding=ExpertParallelBinding.for_experts(E, ExpertParallelGroup.single(), opts))
        return routed(forward)

    def hf(impl: str) -> Step:
        def forward() -> torch.Tensor:
            cfg._experts_implementation = impl
            return experts(hidden, indices, weights)
        return routed(forward)

    def dense() -> dict[str, torch.Tensor]:
        zero(x_dense, w1, w2)
        gate, up = (x_dense @ w1).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ w2
        out.backward(grad_dense)
        return {"out": out.detach()}

    return {"hp-grouped": hp("grouped"), "hp-eager": hp("eager"), "hf-grouped": hf("grouped_mm"),
             "hf-eager": hf("eager"), DENSE: dense}


def check_hf_grouped_dispatch(step: Step) -> None:
    """Run hf-grouped once with transformers' grouped_mm_experts_forward wrapped: it must be called."""
    calls = []
    original = hf_moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"]

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    hf_moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"] = counted  # local override of the interface mapping
    try:
        step()
    finally:
        del hf_moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    if original is not hf_moe.grouped_mm_experts_forward or len(calls) != 1:
        raise SystemExit(f"hf-grouped did not go through grouped_mm_experts_forward (calls={len(calls)})")


def max_rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def profile(steps: dict[str, Step], names: list[str], rows: int) -> dict[str, str]:
    tables = {}
    for name in names:
        steps[name]()  # warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False) as prof:
            steps[name]()
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        print(f"\nprofile: {name} (one forward+backward, sorted by self CPU time)\n{tables[name]}")
    return tables


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    console = Console(width=max(Console().width, 110))  # no truncated columns when piped
    T, H, inter, K = a.tokens, a.hidden, a.intermediate, a.top_k
    fwd_flops = 2 * T * K * H * (2 * inter) + 2 * T * K * inter * H
    step_flops = 3 * fwd_flops  # backward = 2x forward

    steps = build_steps(a)
    check_hf_grouped_dispatch(steps[REFERENCE])

    times: dict[str, list[float]] = {name: [] for name in steps}
    errors: dict[str, dict[str, float]] = {}
    first: dict[str, dict[str, torch.Tensor]] = {}
    for it in range(a.warmup + a.iters):
        for name, step in steps.items():
            t0 = time.perf_counter()
            result = step()
            dt = time.perf_counter() - t0
            if it >= a.warmup:
                times[name].append(dt)
            if it == 0 and name != DENSE:
                first[name] = {k: v.clone() for k, v in result.items()}
        if it == 0:
            ref = first.pop(REFERENCE)
            errors = {n: {k: max_rel_err(v, ref[k]) for k, v in r.items()} for n, r in first.items()}
            first.clear()

    med = {name: statistics.median(ts) for name, ts in times.items()}
    table = Table(title=f"experts fwd+bwd  T={T} H={H} I={inter} E={a.experts} K={K} fp32 CPU "
                        f"threads={torch.get_num_threads()} iters={a.iters}")
    table.caption = f"speed and max rel err are relative to {REFERENCE}; 'of dense' = dense time / variant time"
    for col in ("variant", "median ms", "tokens/s", "GFLOP/s", f"vs {REFERENCE}", "of dense", "max rel err"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    results = {}
    for name, t in med.items():
        err = max(errors[name].values()) if name in errors else None
        results[name] = {"median_s": t, "min_s": min(times[name]), "times_s": times[name], "tokens_per_s": T / t,
                         "gflop_per_s": step_flops / t / 1e9, "speed_vs_reference": med[REFERENCE] / t,
                         "fraction_of_dense": med[DENSE] / t, "max_rel_err": errors.get(name)}
        table.add_row(name, f"{t * 1e3:.1f}", f"{T / t:,.0f}", f"{step_flops / t / 1e9:.1f}",
                      f"{med[REFERENCE] / t:.2f}x", f"{med[DENSE] / t:.0%}",
                      "ref" if name == REFERENCE else "-" if err is None else f"{err:.1e}")
    console.print(table)

    report = {
        "command": shlex.join(["python", *sys.argv]),
        "sizes": {"tokens": T, "hidden": H, "intermediate": inter, "experts": a.experts, "top_k": K},
        "dtype": "float32", "device": "cpu", "ep": 1, "iters": a.iters, "warmup": a.warmup, "seed": a.seed,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "load_average_1_5_15min": os.getloadavg(),  # the machine may be shared: read timings with this
        "flops_forward": fwd_flops, "flops_step": step_flops, "reference": REFERENCE, "results": results,
    }
    if a.profile:
        report["profile"] = profile(steps, ["hp-grouped", REFERENCE], a.profile_rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
