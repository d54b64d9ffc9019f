"""One device check for whatever accelerator is present: CUDA, Ascend NPU, else CPU at small sizes (CI).

(a) Whole-model parity at EP=1 on the device, fp32 and bf16: a tiny random Qwen3-MoE rewritten with
    ``runtime.compute: auto`` against the unmodified model, logits and every gradient (relative to
    the largest reference value; tolerances fp32 1e-5 on CPU, 1e-4 on an accelerator (TF32-free
    matmuls still reorder sums), bf16 3e-2). The expert-compute backend chosen, and why, is recorded.
(b) Local experts forward + backward at a realistic shape (Qwen3-30B-A3B experts: H 2048, I 768,
    E 128, top-8, T 16384, bf16 on an accelerator; tiny fp32 on CPU):
      ``hp``          hp_rewrite.runtime.pipeline.dispatch.moe_forward (EP=1, ``compute: auto``: grouped_mm / npu ops)
      ``hf-grouped``  transformers' Qwen3MoeExperts with ``_experts_implementation = "grouped_mm"``
      ``dense``       the ceiling: ``x[T*K, H] @ W1[H, 2I] -> SwiGLU -> @ W2[I, H]``, no routing
    Timed with a device synchronisation around each iteration; the median is reported, with tokens/s
    and, on CUDA, the peak ``max_memory_allocated`` of one forward + backward; the kernels that ran
    (profiler: the grouped CUTLASS kernel, or torch's fallback) are listed.
(c) EP=2 as two processes on the one device (gloo over device tensors; :mod:`tools.device_ep`): bf16
    parity and bitwise repeatability of qwen3_moe and deepseek_v3, host syncs per MoE layer
    (``set_sync_debug_mode``), single-token decode (empty expert groups, a rank receiving nothing),
    context parallelism (``cp_size: 2``, Ulysses: parity, host syncs per attention forward),
    qwen3_moe with ``runtime.balance`` forced on (lent expert weights and their gradients returned), and
    on an accelerator one Qwen3-30B-A3B-shaped layer's local experts at EP=2 against transformers'
    grouped_mm.
(d) Local experts kept as MXFP4 / block-FP8 codes (:mod:`tools.device_kept`) against the same values
    held in bf16: differences, time, peak memory, host syncs; and ``runtime.fp8_gemm`` (FP8 GEMMs on
    the block-FP8 codes, ``scaled_mm`` 1x128 x 128x128 on sm90): its error and speed against them.

Prints a table and writes JSON (``--out``, default ``bench-results/device_check.json``)::

    python tools/device_check.py                 # sizes for the device found
    python tools/device_check.py --size small    # CPU/CI sizes anywhere
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
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SIZES = {
    "realistic": {"tokens": 16384, "hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8},
    "small": {"tokens": 256, "hidden": 64, "intermediate": 32, "experts": 8, "top_k": 2},
}
TOL = {"float32": 1e-5, "bfloat16": 3e-2}


def detect_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return "npu"
    except Exception:  # noqa: BLE001 - no Ascend stack here
        pass
    return "cpu"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "npu":
        torch.npu.synchronize()


def parity(device: str, dtype: torch.dtype) -> dict:
    """Rewritten tiny Qwen3-MoE (EP=1, compute auto) against the unmodified model, on ``device``."""
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.rewrite import generate, install
    from hp_rewrite.runtime.group.groups import ExpertParallelGroup
    from hp_rewrite.tiny import build_tiny_model, tiny_config
    from hp_rewrite.verify import gradient_errors, kernel_choices

    plan = parse_plan("version: 1\nep_size: 1\nruntime:\n  compute: auto\n")
    ref = build_tiny_model(tiny_config("qwen3_moe"), seed=0).to(device=device, dtype=dtype)
    model = copy.deepcopy(ref)
    with tempfile.TemporaryDirectory() as out:
        _, artifact = generate(model, plan, model.config, Path(out))
        install(model, artifact, plan, ExpertParallelGroup.single())
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen).to(device)
    ref_out, out = ref(input_ids=ids).logits, model(input_ids=ids).logits
    upstream = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    (ref_out * upstream).sum().backward()
    (out * upstream).sum().backward()
    logits = ((out - ref_out).float().abs().max() / ref_out.float().abs().max()).item()
    grads = gradient_errors(model, ref, ExpertParallelGroup.single(), 1)
    worst = max(grads, key=lambda n: grads[n][1])
    name = str(dtype).replace("torch.", "")
    tol = TOL[name] if device == "cpu" or dtype != torch.float32 else 1e-4
    return {"dtype": name, "logits_max_rel": logits, "grad_max_rel": grads[worst][1], "worst_grad": worst,
            "tolerance": tol, "passed": max(logits, grads[worst][1]) <= tol,
            "kernels": kernel_choices(model, "auto", device, dtype)}


def bench_steps(size: dict, device: str, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hp_rewrite.runtime.group.groups import ExpertParallelGroup
    from hp_rewrite.runtime.options import RuntimeOptions
    from hp_rewrite.runtime.pipeline.dispatch import moe_forward
    from hp_rewrite.runtime.pipeline.layer import ExpertParallelBinding

    T, H, inter, E, K = (size[k] for k in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=K)
    experts = Qwen3MoeExperts(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.02)
        experts.down_proj.normal_(std=0.02)
    hidden = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    top_w, indices = torch.randn(T, E, device=device).softmax(-1).topk(K, dim=-1)
    weights = top_w.to(dtype).detach().requires_grad_()
    grad_out = torch.randn(T, H, device=device, dtype=dtype)
    x_dense = torch.randn(T * K, H, device=device, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(H, 2 * inter, device=device, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(inter, H, device=device, dtype=dtype) * 0.02).requires_grad_()
    grad_dense = torch.randn(T * K, H, device=device, dtype=dtype)
    opts = RuntimeOptions(compute="auto")

    def zero(*ts):
        for t in ts:
            t.grad = None

    def hp() -> None:
        zero(hidden, weights, experts.gate_up_proj, experts.down_proj)
        moe_forward(hidden, indices, weights, experts,
                    binding=ExpertParallelBinding.for_experts(E, ExpertParallelGroup.single(), opts)).backward(grad_out)

    def hf() -> None:
        zero(hidden, weights, experts.gate_up_proj, experts.down_proj)
        cfg._experts_implementation = "grouped_mm"
        experts(hidden, indices, weights).backward(grad_out)

    def dense() -> None:
        zero(x_dense, w1, w2)
        gate, up = (x_dense @ w1).chunk(2, dim=-1)
        ((F.silu(gate) * up) @ w2).backward(grad_dense)

    return {"hp": hp, "hf-grouped": hf, "dense": dense}


def bench(size: dict, device: str, dtype: torch.dtype, iters: int, warmup: int) -> dict:
    steps = bench_steps(size, device, dtype)
    times: dict[str, list[float]] = {n: [] for n in steps}
    for it in range(warmup + iters):
        for name, step in steps.items():  # round-robin: machine noise hits every variant alike
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            if it >= warmup:
                times[name].append(time.perf_counter() - t0)
    T, H, inter, K = (size[k] for k in ("tokens", "hidden", "intermediate", "top_k"))
    flops = 3 * (2 * T * K * H * 2 * inter + 2 * T * K * inter * H)  # fwd + bwd (2x fwd), matmuls only
    med = {n: statistics.median(ts) for n, ts in times.items()}
    peaks = {n: peak_bytes(step, device) for n, step in steps.items()}
    return {n: {"median_s": t, "times_s": times[n], "tflop_per_s": flops / t / 1e12, "tokens_per_s": T / t,
                "peak_bytes": peaks[n], "speed_vs_hf_grouped": med["hf-grouped"] / t,
                "fraction_of_dense": med["dense"] / t}
            for n, t in med.items()} | {"flops_step": flops, "kernels": kernels_run(steps["hp"], device)}


def peak_bytes(step: Callable[[], None], device: str) -> int | None:
    """Peak device memory of one call above what was allocated before it (CUDA only)."""
    if device != "cuda":
        return None
    sync(device)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    sync(device)
    return torch.cuda.max_memory_allocated() - base


def kernels_run(step: Callable[[], None], device: str) -> dict[str, int]:
    """GEMM kernels (device) or ops (CPU) one call ran, by name: which grouped GEMM ran, or its fallback."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        step()
        sync(device)
    names: dict[str, int] = {}
    for e in prof.events():
        if any(k in e.name.lower() for k in ("grouped", "gemm", "cutlass", "_mm", "matmul")):
            names[e.name[:120]] = names.get(e.name[:120], 0) + 1
    return dict(sorted(names.items(), key=lambda kv: -kv[1])[:12])


def ep2_on_one_device(device: str, dtype: torch.dtype, size_name: str, iters: int) -> dict:
    """Section (c): two ranks on this device (see tools/device_ep.py)."""
    from hp_rewrite.launch import run_world

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the workers import tools.device_ep
    speed = {**SIZES["realistic"], "tokens": 4096} if size_name == "realistic" else None
    payload = {"device": device, "dtype": str(dtype).replace("torch.", ""), "speed": speed is not None,
               "size": speed, "iters": iters}
    return {f"rank{r}": out for r, out in enumerate(run_world(2, "tools.device_ep:worker", payload, timeout=420))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["auto", "small", "realistic"], default="auto",
                   help="auto: realistic on an accelerator, small on CPU")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 10 on a device, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-results/device_check.json"))
    a = p.parse_args(argv)
    a.argv = list(argv if argv is not None else sys.argv[1:])
    device = detect_device()
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # a shared CPU: OpenMP barriers of descheduled threads swamp tiny GEMMs
    try:
        return _run(a, device)
    finally:
        torch.set_num_threads(threads)


def _run(a: argparse.Namespace, device: str) -> int:
    import transformers
    from rich.console import Console
    from rich.table import Table

    size_name = a.size if a.size != "auto" else ("small" if device == "cpu" else "realistic")
    size = SIZES[size_name]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    iters = a.iters or (3 if device == "cpu" else 10)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    console = Console(width=max(Console().width, 110))

    checks = [parity(device, dt) for dt in (torch.float32, torch.bfloat16)]
    table = Table(title=f"(a) whole-model parity, tiny qwen3_moe, EP=1, {name}")
    for col in ("dtype", "logits max rel", "grad max rel", "tolerance", "backend", "why", "result"):
        table.add_column(col)
    for c in checks:
        k = c["kernels"][0]
        table.add_row(c["dtype"], f"{c['logits_max_rel']:.1e}", f"{c['grad_max_rel']:.1e}", f"{c['tolerance']:.0e}",
                      k["backend"], k["reason"], "PASS" if c["passed"] else "FAIL")
    console.print(table)

    results = bench(size, device, dtype, iters, a.warmup)
    flops, kernels = results.pop("flops_step"), results.pop("kernels")
    dt = str(dtype).replace("torch.", "")
    table = Table(title=f"(b) local experts fwd+bwd, T={size['tokens']} H={size['hidden']} I={size['intermediate']} "
                        f"E={size['experts']} K={size['top_k']} {dt} on {name}, median of {iters}")
    for col in ("variant", "median ms", "GFLOP/s", "vs hf-grouped", "of dense"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for n, r in results.items():
        table.add_row(n, f"{r['median_s'] * 1e3:.2f}", f"{r['tflop_per_s'] * 1e3:,.1f}", f"{r['speed_vs_hf_grouped']:.2f}x",
                      f"{r['fraction_of_dense']:.0%}")
    console.print(table)
    console.print(f"kernels of one hp step: {kernels}")

    ep2 = ep2_on_one_device(device, torch.bfloat16, size_name, max(3, iters // 2))
    table = Table(title=f"(c) EP=2 as two processes on one {name}, bf16")
    for col in ("rank", "case", "worst rel", "passed", "bitwise repeatable", "syncs / MoE layer (cp: attention) fwd", "bwd syncs"):
        table.add_column(col)
    for rank, cases in ep2.items():
        for case, c in cases.items():
            if case != "layer_speed":
                table.add_row(rank, case, f"{c['worst_rel']:.1e}", str(c["passed"]), str(c["bitwise_repeatable"]),
                              str(c.get("forward_syncs_per_moe_layer")), str(c.get("backward_syncs")))
    console.print(table)
    if "layer_speed" in ep2["rank0"]:
        console.print(f"EP=2 layer local experts vs transformers grouped_mm: {ep2['rank0']['layer_speed']}")
    ep2_passed = all(c["passed"] for cases in ep2.values() for n, c in cases.items() if n != "layer_speed")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools.device_kept import kept_experts

    kept = kept_experts(size, device, max(2, iters // 2), sync)
    table = Table(title=f"(d) local experts kept as MXFP4 / block FP8 vs their decoded bf16 values, frozen, {name}")
    for col in ("format", "out max rel", "dX max rel", "out / dX norm rel", "kept / dense time", "weight MB kept / dense",
                "peak MB kept / dense", "host syncs (kept, EP=1)"):
        table.add_column(col)
    for method, r in kept.items():
        peak = r["peak_bytes"]
        table.add_row(method, f"{r['out_max_rel']:.1e}", f"{r['dx_max_rel']:.1e}",
                      f"{r['out_norm_rel']:.1e} / {r['dx_norm_rel']:.1e}", f"{r['kept_over_dense_time']:.2f}x",
                      f"{r['weight_bytes']['kept'] / 2**20:.1f} / {r['weight_bytes']['dense'] / 2**20:.1f}",
                      f"{peak['kept'] / 2**20:.0f} / {peak['dense'] / 2**20:.0f}" if peak else "-",
                      str(r.get("host_syncs", "-")))
    console.print(table)

    report = {"command": " ".join(["python", "tools/device_check.py", *a.argv]),
              "device": device, "device_name": name, "size": size_name, "sizes": size, "dtype": dt,
              "iters": iters, "torch": torch.__version__, "transformers": transformers.__version__,
              "load_average_1_5_15min": os.getloadavg(), "parity": checks, "flops_step": flops,
              "bench": results, "kernels": kernels, "ep2_one_device": ep2, "kept": kept,
              "passed": all(c["passed"] for c in checks) and ep2_passed and all(r["passed"] for r in kept.values())}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {a.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
