"""The one TP collective DTensor's styles do not cover: a gradient summed over the group."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grads(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over ``group`` (each rank's covers only its own heads)."""
    return _SumGrads.apply(x, group)
