"""Measuring matmul FLOPs with ``torch.utils.flop_counter.FlopCounterMode``, grouped GEMMs included.

torch 2.13's FlopCounterMode has no formula for ``aten._grouped_mm`` (what
``torch.nn.functional.grouped_mm`` dispatches to, forward and backward), so a grouped-GEMM expert
pass counts as 0 FLOPs. :data:`GROUPED_MM_FORMULA` fills the gap through FlopCounterMode's
``custom_mapping``; the cost checks run both ``compute="grouped"`` with it and ``compute="eager"``
(a per-expert ``mm`` loop torch already counts) and expect the same number.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

import torch
from torch.utils.flop_counter import FlopCounterMode


def grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``_grouped_mm(a, b, offs)``: the sum over groups of ``2 * m_g * k_g * n_g``.

    2-D x 3-D (expert forward, input gradient): ``out [M, N]``, shared K -> ``2 * M * N * K``.
    2-D x 2-D (weight gradient, groups split K): ``out [G, M, N]``, the groups' K add up to
    ``a.shape[1]`` -> ``2 * M * N * K_total``. 3-D operands (batched): ``2 * out.numel() * K``.
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out_shape[-2] * out_shape[-1] * a_shape[1]
    return 2 * prod(out_shape) * a_shape[-1]


def _mapping() -> dict:
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    return {op: grouped_mm_flop} if op is not None else {}


def count_flops(fn: Callable[[], object]) -> int:
    """Matmul FLOPs of everything ``fn`` runs (call ``backward`` inside ``fn`` to count it too)."""
    with FlopCounterMode(display=False, custom_mapping=_mapping()) as counter:
        fn()
    return counter.get_total_flops()
