"""Section (d) of ``tools/device_check.py``: local experts kept as MXFP4 / block-FP8 codes on the device.

For each format, a Qwen3-MoE experts holder (the size of (b)) gets random weights, quantised in the
format (block FP8: 128x128 blocks, 16x16 at the small size); the kept holder holds the codes
(:class:`hp_rewrite.runtime.compute.quantized.QuantizedWeight`), the dense one their decoded bf16 values,
frozen. Both run ``moe_forward`` at EP=1 forward and backward (dX only: frozen weights). Reported: the
largest difference of the output and of dX relative to the dense holder's (the same values in a
different GEMM grouping: chunks of ``runtime.dequant_chunk_mb``), the median time of each and their
ratio, the peak ``max_memory_allocated`` of each (CUDA; weights included), the resident weight bytes
of each, and on CUDA the host synchronisations of one kept forward + backward
(``set_sync_debug_mode``: at EP=1 the kept path reads the split sizes once per layer when its experts
take several chunks, where the bf16 path reads none).

The ``fp8_gemm`` row runs ``runtime.fp8_gemm``: the block-FP8 codes (128x128 blocks; at the small size
a 128-wide holder) multiplied by FP8 GEMMs (``scaled_mm`` 1x128 x 128x128 on sm90, torch's block
arithmetic in fp32 on CPU), rows quantised per 128 columns: an approximation, passed when the
norm of the difference is within 6e-2 of the decoded experts' (``out_norm_rel``, ``dx_norm_rel``).
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from torch import nn

FP8_GEMM_TOL = 6e-2  # ||kept - dense|| / ||dense||: rows quantised to FP8 per 128 columns (docs/checkpoints.md)


def _holders(size: dict, device: str, method: str, block: tuple[int, int] | None = None):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hp_rewrite.loading.quantized import quantize_fp8, quantize_mxfp4
    from hp_rewrite.runtime.compute.quantized import QuantizedWeight

    H, inter, E = size["hidden"], size["intermediate"], size["experts"]
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E)
    block = block or ((128, 128) if H >= 1024 else (16, 16))
    kept, dense = Qwen3MoeExperts(cfg), Qwen3MoeExperts(cfg)
    gen = torch.Generator().manual_seed(0)
    for name in ("gate_up_proj", "down_proj"):
        w = torch.randn(getattr(kept, name).shape, generator=gen) * 0.02  # [E, out, in]
        if method == "mxfp4":  # blocks along in, as gpt-oss stores them; this holder is out-first
            q = QuantizedWeight.mxfp4(*quantize_mxfp4(w), torch.bfloat16, in_first=False)
        else:
            codes, scales = zip(*[quantize_fp8(w[e], block) for e in range(E)], strict=True)
            q = QuantizedWeight.fp8(torch.stack(codes), torch.stack(scales), block, torch.bfloat16)
        values = q.dense()
        setattr(kept, name, nn.Parameter(q.to(device), requires_grad=False))
        setattr(dense, name, nn.Parameter(values.contiguous().to(device), requires_grad=False))
    return kept, dense


def kept_experts(size: dict, device: str, iters: int, sync) -> dict:
    out = {}
    wide = {**size, "hidden": max(size["hidden"], 128), "intermediate": -(-size["intermediate"] // 128) * 128}
    for row, method, shape in (("mxfp4", "mxfp4", size), ("fp8", "fp8", size), ("fp8_gemm", "fp8", wide)):
        out[row] = _compare(row, method, shape, device, iters, sync)
    return out


def _compare(row: str, method: str, size: dict, device: str, iters: int, sync) -> dict:
    from hp_rewrite.runtime import installed
    from hp_rewrite.runtime.binding.install import install_expert_parallel
    from hp_rewrite.runtime.group.groups import ExpertParallelGroup
    from hp_rewrite.runtime.options import RuntimeOptions
    from hp_rewrite.runtime.pipeline.dispatch import moe_forward

    T, E, K, H = size["tokens"], size["experts"], size["top_k"], size["hidden"]
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(T, H, generator=gen) * 0.5).to(device=device, dtype=torch.bfloat16)
    top_w, indices = torch.randn(T, E, generator=gen).softmax(-1).topk(K, dim=-1)
    top_w, indices = top_w.to(device=device, dtype=torch.bfloat16), indices.to(device)
    grad_out = torch.randn(T, H, generator=gen).to(device=device, dtype=torch.bfloat16)
    fp8 = row == "fp8_gemm"
    kept, dense = _holders(size, device, method, (128, 128) if fp8 else None)
    for holder in (kept, dense):  # bound as the rewrite binds them: the holder reads its plan's options
        install_expert_parallel(holder, num_experts=E, ep=ExpertParallelGroup.single(),
                                options=RuntimeOptions(fp8_gemm=fp8 and holder is kept))
    results, times, peaks = {}, {"kept": [], "dense": []}, {}

    def step(holder):
        hidden = x.detach().requires_grad_()
        y = moe_forward(hidden, indices, top_w, holder, binding=installed.binding(holder))
        y.backward(grad_out)
        return y.detach(), hidden.grad

    for name, holder in (("kept", kept), ("dense", dense)):
        results[name] = step(holder)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            step(holder)
            peaks[name] = torch.cuda.max_memory_allocated()
        for _ in range(iters):
            sync(device)
            t0 = time.perf_counter()
            step(holder)
            sync(device)
            times[name].append(time.perf_counter() - t0)
    pairs = list(zip(results["kept"], results["dense"], strict=True))
    rel = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in pairs]
    norm_rel = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in pairs]
    med = {n: statistics.median(ts) for n, ts in times.items()}
    held = {"kept": sum(p.stored_bytes for p in kept.parameters()),
            "dense": sum(p.numel() * p.element_size() for p in dense.parameters())}
    out = {"out_max_rel": rel[0], "dx_max_rel": rel[1], "out_norm_rel": norm_rel[0], "dx_norm_rel": norm_rel[1],
           "median_s": med, "kept_over_dense_time": med["kept"] / med["dense"], "weight_bytes": held,
           "peak_bytes": peaks or None, "shape": size,
           "passed": max(norm_rel) <= FP8_GEMM_TOL if fp8 else max(rel) <= 2e-2}
    if device == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(kept)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out["host_syncs"] = sum("synchroniz" in str(w.message) for w in caught)
    return out
