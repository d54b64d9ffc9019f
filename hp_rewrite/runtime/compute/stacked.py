"""Grouped GEMMs over experts held as modules, without keeping a stacked copy of their weights.

A ``ModuleList`` of experts keeps one ``[out, in]`` weight per expert; grouped_mm wants them as one
``[E, in, out]`` tensor. Stacking them with autograd (``torch.stack``) makes a copy that grouped_mm
saves for its backward: the layer's local expert weights, held from the forward to the backward, in
every MoE layer at once (NLLB-MoE at EP=8: about 1 GB per layer in bf16). Here the copy is made for
the forward GEMM and made again in the backward, and only the parameters themselves (no copy) are
saved: one layer's copy at a time, and only while its GEMM runs. The backward is grouped_mm's own:
``dX = dY @ W^T`` (m-grouped) and ``dW_e = X_e^T @ dY_e`` (k-grouped), each expert's gradient a
slice of the second, so the gradients are those of the stacked path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable


class StackedParams:
    """One role's weights of the held experts (``[out, in]`` each), stacked only where needed."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = tuple(params)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.params), *self.params[0].shape))

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def stacked(self) -> torch.Tensor:
        """The differentiable copy (what the other backends take)."""
        return torch.stack(self.params)

    def to(self, dtype: torch.dtype) -> StackedParams:
        """Each expert's weight in ``dtype`` (autocast's cast; no copy where it is already)."""
        return self if dtype == self.dtype else StackedParams([p.to(dtype) for p in self.params])


def _mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return (getattr(F, "grouped_mm", None) or torch._grouped_mm)(a, b, offs=offsets)


class _StackedGroupedMM(Function):
    @staticmethod
    def forward(ctx, x, offsets, transposed, *params):  # type: ignore[override]
        w = torch.stack(params)
        ctx.save_for_backward(x, offsets, *params)
        ctx.transposed = transposed
        return _mm(x, w if transposed else w.transpose(1, 2), offsets)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        x, offsets, *params = ctx.saved_tensors
        grad = grad.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            w = torch.stack(params)  # made again: [E, in, out] transposed, else [E, out, in]
            dx = _mm(grad, w.transpose(1, 2) if ctx.transposed else w, offsets)
        dws = [None] * len(params)
        if any(ctx.needs_input_grad[3:]):  # k-grouped, in each weight's own layout: contiguous slices
            dw = _mm(x.t(), grad, offsets) if ctx.transposed else _mm(grad.t(), x, offsets)
            dws = list(dw.unbind(0))
        return dx, None, None, *dws


def stacked_grouped_mm(x: torch.Tensor, weight: StackedParams, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``x_e @ W_e`` for each expert e over its rows (``offsets``), ``W_e`` read from the held experts'
    own weights (stored ``[in, out]`` when ``transposed``, else ``[out, in]``)."""
    return _StackedGroupedMM.apply(x, offsets, transposed, *weight.params)
