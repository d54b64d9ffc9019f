"""The experts a rank computes for others in one layer (``runtime.balance``): their weights lent by
the owner for the layer, their gradients summed back into the owner's.

The owner picks the lent experts out of each stacked weight (:class:`_Lent`: its backward adds an
expert's copies' gradients in a fixed order, one small matmul, no atomics) and sends them with the
differentiable all-to-all, cast to the autocast dtype first (the dtype the owner's GEMMs would read
them in). The helper runs its guests' rows through them after its own experts' rows
(:func:`guest_rows`). The copies are not parameters: no optimizer state, no checkpoint; they live as
long as the layer's autograd graph, like activations. Autograd brings their gradients back through
the reverse all-to-all into the owner's weight gradient, so a hook on the weight (DDP, the gradient
sync) sees the whole gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.autograd import Function

from .. import installed
from ..compute.batch import LocalBatch
from ..compute.experts import ExpertsLayout, local_experts_forward
from ..compute.quantized import projection_of
from ..transport import comm


class _Lent(Function):
    """``weight[index]``; backward: each expert's gradient is the sum of its copies' (fixed order)."""

    @staticmethod
    def forward(ctx, weight, index):  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.experts = weight.shape[0]
        return weight.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        pick = (torch.arange(ctx.experts, device=index.device).unsqueeze(1) == index.unsqueeze(0)).to(grad.dtype)
        return (pick @ grad.reshape(index.numel(), -1)).view(ctx.experts, *grad.shape[1:]), None


class _Joined(Function):
    """``rows`` unchanged; in backward, zero gradients for ``received`` (empty): a rank with no guest
    still joins the all-to-all that returns the weight gradients, at the place its guests would have."""

    @staticmethod
    def forward(ctx, rows, *received):  # type: ignore[override]
        ctx.like = [(r.shape, r.dtype) for r in received]
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (grad, *(grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.like))


@dataclass
class Guests:
    """This layer's lent weights in flight (per weight name) and how many experts this rank computes for others."""

    pending: dict[str, comm.PendingExchange]
    shapes: dict[str, torch.Size]
    count: int

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.wait().view(self.count, *self.shapes[n]) for n, p in self.pending.items()}


def refusal(experts: nn.Module, holder: nn.Module | None) -> str | None:
    """Why ``runtime.balance`` cannot lend the experts of ``experts`` (its holder: ``holder``) yet, or None."""
    if holder is None:
        return f"{type(experts).__name__} is not an installed experts holder"
    name, layout = type(holder).__name__, installed.layout(holder)
    if experts is not holder:
        return (f"{name} is wrapped ({type(experts).__name__}): LoRA or modules_to_save on the experts; lending "
                "their adapters is not supported yet")
    if installed.fsdp_sharded(holder):
        return f"{name}'s experts are sharded by FSDP2; lending sharded experts is not supported yet"
    if layout.modules or layout.flat or layout.split:
        return f"{name} holds its experts as modules or flat or split weights; only stacked 3-D weights are lent"
    if any(projection_of(holder, n, name, 1, False) is not None for n in layout.weight_names):
        return f"{name} keeps its experts quantised (codes and scales); they are not lent"
    return None


def lend(holder: nn.Module, layout: ExpertsLayout, send_local: torch.Tensor, sends: list[int], recvs: list[int],
         link, dtype: torch.dtype | None) -> Guests:
    """Start sending this rank's lent experts' weights (``send_local``, destination-major, ``sends[r]`` to
    rank ``r``) and receiving ``recvs[r]`` experts from each rank ``r``. ``dtype``: the autocast dtype."""
    pending, shapes = {}, {}
    index = send_local[: sum(sends)]
    for name in layout.roles:
        weight = layout.weight(holder, name)
        shapes[name] = weight.shape[1:]
        grad = weight.requires_grad and torch.is_grad_enabled()
        if index.numel():
            sent = _Lent.apply(weight, index) if grad else weight.index_select(0, index)
        else:  # a leaf, so this rank's reverse all-to-all runs in backward too
            sent = weight.new_empty((0, *weight.shape[1:]), requires_grad=grad)
        if dtype is not None and sent.is_floating_point():
            sent = sent.to(dtype)
        rows = sent.reshape(sent.shape[0], shapes[name].numel())  # one row per expert
        pending[name] = comm.exchange(rows, recvs, sends, link.group, link.overlap, link.hooks)
    return Guests(pending, shapes, sum(recvs))


def split(batch: LocalBatch, num_local: int, guests: int) -> tuple[LocalBatch, LocalBatch]:
    """The rows of this rank's own experts, and its guests' (each with its groups' counts and offsets)."""
    counts = batch.counts
    own = sum(counts[:num_local])
    mine = replace(batch, hidden=batch.hidden[:own], known_counts=counts[:num_local],
                   offsets=batch.offsets[:num_local])
    theirs = replace(batch, hidden=batch.hidden[own:], known_counts=counts[num_local : num_local + guests],
                     offsets=batch.offsets[num_local : num_local + guests] - own)
    return mine, theirs


def guest_rows(holder: nn.Module, layout: ExpertsLayout, guests: Guests, batch: LocalBatch,
               own: torch.Tensor) -> torch.Tensor:
    """The guests' rows through their lent weights, to follow ``own`` (this rank's experts' rows); on a
    rank with no guest ``[0, H]`` in ``own``'s dtype, joined to the weights' backward exchange."""
    weights = guests.weights()
    if guests.count:
        return local_experts_forward(holder, batch, layout, weights=weights)
    rows = own.new_zeros((0, own.shape[-1]))
    received = [w for w in weights.values() if w.requires_grad]
    return _Joined.apply(rows, *received) if received else rows
