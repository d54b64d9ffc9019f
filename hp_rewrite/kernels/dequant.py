"""Decoding MXFP4 and block-FP8 expert weights on their own device, a few experts at a time.

What the runtime calls when experts are kept in the format the Hub ships them in
(:mod:`hp_rewrite.runtime.compute.quantized`). The values are transformers' ``Mxfp4Dequantize`` /
``Fp8Dequantize`` values bit for bit (decoded in fp32, one rounding to the compute dtype after), and
nothing is uploaded from the host: the E2M1 table is built on the device from an ``arange``, block
scales are expanded with integer repeats.
"""

from __future__ import annotations

import torch

__all__ = ["decode_fp8", "decode_mxfp4", "e2m1_table"]


def e2m1_table(device: torch.device) -> torch.Tensor:
    """The fp32 value of each 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit), made on ``device``."""
    code = torch.arange(16, device=device, dtype=torch.int32)
    exponent, mantissa = (code >> 1) & 3, (code & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.ldexp(1.0 + 0.5 * mantissa, exponent - 1))
    return torch.where((code >> 3) == 1, -magnitude, magnitude)


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., G, 16]`` uint8 code pairs (low nibble first) and ``[..., G]`` uint8 exponents (+127) ->
    ``[..., G * 32]`` fp32: ``e2m1 * 2 ** (scale - 127)``."""
    table = e2m1_table(blocks.device)
    out = torch.empty(*blocks.shape[:-1], 2 * blocks.shape[-1], dtype=torch.float32, device=blocks.device)
    out[..., 0::2] = table[(blocks & 0x0F).int()]
    out[..., 1::2] = table[(blocks >> 4).int()]
    torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1), out=out)
    return out.flatten(-2)


def decode_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[..., R, C]`` float8_e4m3fn and its block scales ``[..., ceil(R/b0), ceil(C/b1)]`` (fp32, or
    uint8 UE8M0 exponents) -> ``[..., R, C]`` fp32, each value times its block's scale."""
    scales = scale_inv.to(torch.float32)
    if scale_inv.dtype == torch.uint8:
        scales = (scales - 127.0).exp2()
    rows, cols = weight.shape[-2:]
    values = weight.to(torch.float32)
    if rows % block[0] == 0 and cols % block[1] == 0:  # blocks tile the weight: a broadcast, no scale copy
        grid = values.view(*values.shape[:-2], rows // block[0], block[0], cols // block[1], block[1])
        grid.mul_(scales.unsqueeze(-1).unsqueeze(-3))
        return values
    per_value = scales.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    per_value = per_value.repeat_interleave(block[1], dim=-1)[..., :cols]
    return values.mul_(per_value)
