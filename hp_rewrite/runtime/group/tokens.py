"""Sharing a TP group's tokens out and gathering them back, with exact gradients.

The ranks of a tensor-parallel group hold the same tokens (one batch; under sequence parallelism the
MoE block gathers the sequence first). So that no token is routed twice, each rank dispatches only
its share: the rows ``[start, end)`` of ``torch.tensor_split`` over the group (uneven when the count
does not divide, a rank may get none: one token of a decode step). The two autograd functions keep
the gradients exact without any hook on a parameter:

* :func:`share` (forward: this rank's rows; backward: the rows' gradients gathered from every rank).
  Its input is replicated over the group, and everything the group computes from it in full (the
  router on every token, the shared expert) already gets complete gradients; gathering the shares'
  gradients completes the rest, so the input's gradient is whole and the same on every rank.
* :func:`gather` (forward: every rank's rows, in rank order; backward: this rank's rows of the
  gradient). Its output is used the same way on every rank, so its gradient is already whole there.

Megatron names the pair scatter-to / gather-from the sequence-parallel region.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def bounds(length: int, size: int, rank: int) -> tuple[int, int]:
    """``rank``'s rows of ``length`` rows over ``size`` ranks (``torch.tensor_split``'s split)."""
    base, extra = divmod(length, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def all_gather_rows(x: torch.Tensor, length: int, group, size: int) -> torch.Tensor:
    """Every rank's rows of ``length`` (dim 0), in rank order; ranks hold ``bounds`` rows each."""
    most = bounds(length, size, 0)[1]
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    counts = [end - start for start, end in (bounds(length, size, r) for r in range(size))]
    return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])


class _Share(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank, size, dim):
        ctx.group, ctx.rank, ctx.size, ctx.dim, ctx.length = group, rank, size, dim, x.shape[dim]
        start, end = bounds(x.shape[dim], size, rank)
        return x.narrow(dim, start, end - start).clone()

    @staticmethod
    def backward(ctx, grad):
        rows = grad.movedim(ctx.dim, 0)
        full = all_gather_rows(rows.contiguous(), ctx.length, ctx.group, ctx.size)
        return full.movedim(0, ctx.dim), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank, size, dim, length):
        ctx.rank, ctx.size, ctx.dim, ctx.length = rank, size, dim, length
        full = all_gather_rows(x.movedim(dim, 0).contiguous(), length, group, size)
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        start, end = bounds(ctx.length, ctx.size, ctx.rank)
        return grad.narrow(ctx.dim, start, end - start).clone(), None, None, None, None, None


def share(x: torch.Tensor, group, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    """This rank's rows (along ``dim``) of ``x``, the same on every rank of ``group``."""
    if size == 1:
        return x
    return _Share.apply(x, group, rank, size, dim)


def gather(x: torch.Tensor, group, rank: int, size: int, length: int, dim: int = 0) -> torch.Tensor:
    """Every rank's rows (along ``dim``), ``length`` in all: the inverse of :func:`share`."""
    if size == 1:
        return x
    return _Gather.apply(x, group, rank, size, dim, length)


def same_on_every_rank(x: torch.Tensor, group, size: int) -> bool:
    """Whether every rank of ``group`` holds the same ``x``, element for element and in the same order
    (sums weighted by position: one batch's rows in another order differ too). A host read: call it once,
    not per step."""
    values = x.detach().double().flatten()
    place = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=x.device)
    mine = torch.stack([values.sum(), (values * place).sum(), (values.square() * place.remainder(7)).sum(),
                        torch.tensor(float(values.numel()), dtype=torch.float64, device=x.device)])
    seen = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(seen, mine, group=group)
    return all(torch.allclose(s, seen[0], rtol=1e-9, atol=0.0) for s in seen)
