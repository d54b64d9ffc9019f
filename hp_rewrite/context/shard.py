"""One forward's split of the sequence over a context group, and the gather that undoes it.

Every rank of a context group holds the same batch. After the embeddings each keeps its share of every
sequence (the rows ``[start, end)`` of ``torch.tensor_split`` along the sequence: uneven when the length
does not divide, a rank may hold none), and the decoder's output is gathered back whole, so the head, the
loss and everything after run as in the unmodified model, on the same values on every rank.

Gradients. Every rank computes the same loss from the gathered output, so each holds the complete
gradient of it; :func:`gather_sequence`'s backward keeps this rank's rows of it *times the group size*. Every
parameter then gets ``cp_size`` times the part of its gradient its own share of the sequence makes, and
the mean over the data-parallel x context ranks that DDP, FSDP2 and ``hp_rewrite.sync_gradients``
already take is the unmodified model's gradient averaged over the batches: the sum over the context
group, the mean over data parallelism. To the runtime and the gradient contract a context rank is one
more data-parallel rank; a parameter used after the gather (the head) gets the same whole gradient on
every rank of the group, which that mean keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd import Function

from ..runtime.group.tokens import all_gather_rows, bounds


@dataclass(frozen=True)
class Shares:
    """This forward's split: the sequence ``length``, the context ``group`` of ``size`` ranks, this ``rank``."""

    group: object
    rank: int
    size: int
    length: int

    @property
    def lengths(self) -> list[int]:
        """How many positions each rank of the group holds, in rank order."""
        return [end - start for start, end in (bounds(self.length, self.size, r) for r in range(self.size))]

    @property
    def mine(self) -> tuple[int, int]:
        """This rank's positions ``[start, end)``."""
        return bounds(self.length, self.size, self.rank)


def share_sequence(x: torch.Tensor, shares: Shares, dim: int = 1) -> torch.Tensor:
    """This rank's positions of ``x`` along ``dim`` (a copy: the whole sequence is not kept alive by it).
    Its backward puts the gradient back at those positions, zeros elsewhere."""
    start, end = shares.mine
    return x.narrow(dim, start, end - start).clone()


class _Gather(Function):
    @staticmethod
    def forward(ctx, x, shares, dim):  # type: ignore[override]
        ctx.shares, ctx.dim = shares, dim
        rows = all_gather_rows(x.movedim(dim, 0).contiguous(), shares.length, shares.group, shares.size)
        return rows.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        start, end = ctx.shares.mine
        return grad.narrow(ctx.dim, start, end - start) * ctx.shares.size, None, None


def gather_sequence(x: torch.Tensor, shares: Shares, dim: int = 1) -> torch.Tensor:
    """Every rank's positions of ``x`` along ``dim``, in order: the whole sequence, the same on every rank of
    the group. Backward: this rank's positions of the gradient, times the group size (module doc)."""
    return _Gather.apply(x, shares, dim)


def gather_token_rows(x: torch.Tensor, shares: Shares, batch: int) -> torch.Tensor:
    """``[batch * local, ...]`` rows in (sequence, position) order, as routers' logits come, gathered into
    ``[batch * length, ...]`` rows in the unmodified model's order."""
    local = x.shape[0] // batch
    whole = gather_sequence(x.reshape(batch, local, *x.shape[1:]), shares, dim=1)
    return whole.reshape(batch * shares.length, *x.shape[1:])
