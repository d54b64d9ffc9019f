"""Block-FP8 GEMMs on experts kept as the Hub's FP8 codes (``runtime.fp8_gemm``), DeepSeek-V3's recipe.

The weight is used as stored: float8_e4m3fn codes ``[out, in]`` with one scale per 128 x 128 block.
The rows are quantised the same way per 128 columns (1 x 128 groups: an fp32 scale ``amax / 448``
per row and group), and each product is ``sum over k-groups of scale_x * scale_w * (codes_x .
codes_w)``, accumulated in fp32. On CUDA sm90 that is ``torch.nn.functional.scaled_mm`` with
``BlockWise1x128`` x ``BlockWise128x128`` scales, laid out as its kernel requires (``scale_x``
column-major ``[rows, in/128]``, ``scale_w`` ``[round_up(in/128, 4), out/128]`` column-major). On the
CPU the same arithmetic runs in fp32 (what the tests run; torch has no CPU kernel for block scales).
The CUDA call has not run on a GPU yet: ``tools/device_check.py`` (d) measures it the day one is lent.

Quantising the rows is an approximation (about 2**-4 relative per value): docs/checkpoints.md gives
the measured error. The weights' own values are not changed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["BLOCK", "blockwise_mm", "fp8_gemm_problem", "quantize_rows", "row_slice", "weight_scales"]

BLOCK = 128
E4M3_MAX = 448.0


def fp8_gemm_problem(device: torch.device, block: tuple[int, int] | None, dims: tuple[int, int],
                     capability: tuple[int, int] | None = None) -> str | None:
    """Why a block-FP8 weight ``[out, in]`` (``dims``) with ``block`` on ``device`` cannot run FP8 GEMMs,
    or None. ``capability``: the CUDA device's (default: read from ``device``)."""
    device = torch.device(device)
    device_type = device.type
    if block != (BLOCK, BLOCK):
        return f"its FP8 blocks are {block}, the FP8 GEMM takes 128 x 128 blocks only (DeepSeek-V3's layout)"
    if any(d % BLOCK for d in dims):
        return f"its shape {list(dims)} is not a multiple of 128 in both dimensions"
    if device_type == "cpu":
        return None
    if device_type != "cuda":
        return f"no block-scaled FP8 GEMM on {device_type}"
    if torch.version.hip is not None:
        return "torch's block-scaled FP8 GEMM is CUDA sm90 only, not ROCm"
    if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise128x128"):
        return f"this torch ({torch.__version__}) has no torch.nn.functional.scaled_mm with block scales"
    major, minor = capability or torch.cuda.get_device_capability(device)
    if major != 9:
        return f"torch's block-scaled FP8 GEMM (1x128 x 128x128) runs on sm90 only, this GPU is sm{major}{minor}"
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` rows -> (float8_e4m3fn codes ``[M, K]``, fp32 scales ``[M, K/128]`` column-major):
    ``x ~ codes * scale`` per row and 128 columns, ``scale = amax / 448``."""
    rows, cols = x.shape
    groups = x.float().view(rows, cols // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1)
    scales = torch.empty((cols // BLOCK, rows), dtype=torch.float32, device=x.device).t()  # column-major
    # a normal number at least: a group of zeros (the padding rows of empty groups) must not divide 0 by a
    # subnormal scale that flush-to-zero turns into 0
    scales.copy_((amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny))
    codes = (groups / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(rows, cols), scales


def row_slice(codes: torch.Tensor, scales: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start..stop-1`` of :func:`quantize_rows`' output, their scales column-major again (a copy of
    ``(stop - start) * in/128`` values; the codes are a view)."""
    part = scales[start:stop]
    return codes[start:stop], part if stop - start == scales.shape[0] else part.t().contiguous().t()


def weight_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """Stored block scales ``[..., out/128, in/128]`` (fp32, or uint8 UE8M0 exponents) -> fp32
    ``[..., round_up(in/128, 4), out/128]``, each matrix column-major: the layout torch's kernel takes
    (the padding is never read). One call for all the experts of a weight."""
    scales = scale_inv.float()
    if scale_inv.dtype == torch.uint8:
        scales = (scales - 127.0).exp2()
    in_groups = scales.shape[-1]
    padded = scales.new_zeros((*scales.shape[:-1], -(-in_groups // 4) * 4))
    padded[..., :in_groups] = scales
    return padded.transpose(-1, -2)


def blockwise_mm(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """``rows @ W.T`` from :func:`quantize_rows`' output and a weight's codes ``[out, in]`` with
    :func:`weight_scales`' output, in ``out_dtype``."""
    if codes.device.type == "cuda":
        kinds = F.ScalingType
        return F.scaled_mm(codes, weight.t(), scales, kinds.BlockWise1x128, weight_scale, kinds.BlockWise128x128,
                           output_dtype=out_dtype)
    rows, cols = codes.shape
    out_features = weight.shape[0]
    with torch.autocast(codes.device.type, enabled=False):  # fp32 products, as the kernel accumulates
        x = (codes.float().view(rows, cols // BLOCK, BLOCK) * scales.unsqueeze(-1)).view(rows, cols)
        w_scales = weight_scale.t()[:, : cols // BLOCK]  # [out/128, in/128]
        w = weight.float().view(out_features // BLOCK, BLOCK, cols // BLOCK, BLOCK) * w_scales[:, None, :, None]
        return (x @ w.view(out_features, cols).t()).to(out_dtype)
