"""Ascend NPU grouped GEMM through ``torch_npu.npu_grouped_matmul``.

``npu_grouped_matmul`` (documented in the torch_npu API reference) takes lists of tensors. With
``split_item=3`` and ``group_type=0`` it splits one ``x [N, in]`` along rows into groups whose
*cumulative* ends are ``group_list`` (``group_list_type=0``), multiplies group e by ``weight[e]``
(``[in, out]``), and returns a one-element list holding the concatenated ``[N, out]``. It has no
autograd of its own, so :class:`GroupedMatmul` supplies the backward: ``dx`` is the same grouped GEMM
against the transposed weights, ``dW_e = x_e^T dy_e``.

The argument construction is pure Python/torch and unit-tested on CPU against
:func:`reference_grouped_matmul`, a plain-torch statement of the documented semantics.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch


def available() -> bool:
    """True when torch_npu imports (an Ascend build)."""
    try:
        importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - any import failure means no NPU path
        return False
    return True


def grouped_matmul_args(x: torch.Tensor, weight_in_out: torch.Tensor, counts: list[int]) -> dict:
    """Keyword arguments for ``torch_npu.npu_grouped_matmul`` for rows grouped by expert."""
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(x.device)
    return {
        "x": [x.contiguous()],
        "weight": [weight_in_out.contiguous()],
        "bias": None,
        "group_list": ends,
        "split_item": 3,
        "group_type": 0,
        "group_list_type": 0,
    }


def reference_grouped_matmul(x, weight, bias, group_list, split_item, group_type, group_list_type):
    """Pure-torch statement of the documented semantics for the argument set built above."""
    assert split_item == 3 and group_type == 0 and group_list_type == 0 and bias is None
    (xs,), (w,) = x, weight
    ends = [int(e) for e in group_list.tolist()]
    starts = [0, *ends[:-1]]
    assert len(ends) == w.shape[0] and ends[-1] == xs.shape[0], "group_list must end at the row count"
    out = [xs[s:e] @ w[i] for i, (s, e) in enumerate(zip(starts, ends, strict=True))]
    return [torch.cat(out) if out else xs.new_empty((0, w.shape[-1]))]


def _npu_call(**kwargs):
    import torch_npu  # noqa: PLC0415 - optional dependency, imported on use only

    return torch_npu.npu_grouped_matmul(**kwargs)


class GroupedMatmul(torch.autograd.Function):
    """Grouped ``x_e @ W_e`` with a backward, over an injectable kernel (NPU, or the reference in tests)."""

    @staticmethod
    def forward(ctx, x, weight_in_out, counts, kernel):  # type: ignore[override]
        ctx.save_for_backward(x, weight_in_out)
        ctx.counts, ctx.kernel = counts, kernel
        return kernel(**grouped_matmul_args(x, weight_in_out, counts))[0]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        dx = ctx.kernel(**grouped_matmul_args(grad, w.transpose(1, 2), ctx.counts))[0]
        dw = (
            torch.stack(
                [xe.t() @ ge for xe, ge in zip(x.split(ctx.counts), grad.split(ctx.counts), strict=True)]
            )
            if ctx.counts
            else torch.zeros_like(w)
        )
        return dx, dw, None, None


def grouped_matmul(
    x: torch.Tensor, weight_in_out: torch.Tensor, counts: list[int], kernel: Callable | None = None
) -> torch.Tensor:
    """Differentiable grouped GEMM on Ascend (``kernel`` defaults to ``npu_grouped_matmul``)."""
    return GroupedMatmul.apply(x, weight_in_out, list(counts), kernel or _npu_call)
