"""torch ``grouped_mm`` operand preparation.

``torch._grouped_mm`` (bf16 on CUDA, and on CPU too) needs every row stride 16-byte aligned: the
inner dimension K of ``x [N, K]`` and ``w [E, K, N_out]`` and the output width must be multiples of
8 bf16 (4 fp32) elements.
:func:`aligned` zero-pads whatever is not (padded K columns add zeros to every dot product; padded
output columns are sliced off), keeping the weight's memory order (row- or column-major), so
the result and every gradient are unchanged. Real checkpoints' sizes are multiples of 8; this
matters for odd tiny or pruned models. No host synchronisation: shapes only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def needs_alignment(x: torch.Tensor, w: torch.Tensor, align_bytes: int = 16) -> bool:
    m = max(1, align_bytes // x.element_size())
    return bool(x.shape[-1] % m or w.shape[-1] % m)


def aligned(x: torch.Tensor, w: torch.Tensor, align_bytes: int = 16) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(x, w, out_width)`` with K and the output width padded to multiples of ``align_bytes``."""
    m = max(1, align_bytes // x.element_size())
    k, n = x.shape[-1], w.shape[-1]
    pk, pn = -k % m, -n % m
    if not (pk or pn):
        return x, w, n
    if pk:
        x = F.pad(x, (0, pk))
    column_major = w.transpose(-2, -1).is_contiguous() and not w.is_contiguous()
    if column_major:  # pad the [E, out, in] storage, hand back its transpose
        w = F.pad(w.transpose(-2, -1), (0, pk, 0, pn)).transpose(-2, -1)
    else:
        w = F.pad(w, (0, pn, 0, pk))
    return x, w, n
