"""Ascend grouped GEMM: moved to :mod:`hp_rewrite.kernels.npu` (the kernel backends); re-exported here."""

from __future__ import annotations

from ..kernels.npu import (
    GroupedMatmul,
    GroupedSwiGLU,
    available,
    grouped_matmul,
    grouped_matmul_args,
    grouped_swiglu,
    reference_grouped_matmul,
    weight_grad_args,
)

__all__ = [
    "GroupedMatmul",
    "GroupedSwiGLU",
    "available",
    "grouped_matmul",
    "grouped_matmul_args",
    "grouped_swiglu",
    "reference_grouped_matmul",
    "weight_grad_args",
]
