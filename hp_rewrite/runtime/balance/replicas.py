"""The experts a rank computes for others in one layer (``runtime.balance``): their weights lent by
the owner for the layer, their gradients summed back into the owner's.

The lending happens inside the experts holder's own call (:func:`local_forward`, reached through the
module's ``__call__``), so the weights lent are the ones the owner's own rows meet there: FSDP2 has
gathered its shards (an HSDP replica's too) and PEFT's LoRA on the experts is applied (the weight plus
its adapter's delta, differentiable to the factors). The lent copies' gradients return by autograd
inside the same backward, before FSDP2 reduces the owner's gradient: FSDP2 reduces a holder's gradient
once the gradient of the call's input rows (``LocalBatch.hidden``, or the tokens of an experts-level
call) is done, and the copies' return path (the exchange back, :class:`_Lent`, the weight's or the
factors' accumulation) is made of autograd nodes created after that call began, with no other input,
which autograd runs first of the nodes ready together (it runs the later-made first); a late chunk's
reduction is redone by FSDP2 when an earlier chunk's backward gathers the weights again, or at the end
of the backward. tests/test_fsdp.py checks it (checkpointing, chunks, mixed precision, experts level).

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
from ..compute.experts import ExpertsLayout, local_experts_forward, local_weights
from ..compute.quantized import QuantizedProjection, lora_factors
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


class _Parts:
    """One weight's lent experts in flight: its parts and how to rebuild it on arrival.

    A dense weight travels as one part, in the autocast dtype; with PEFT's LoRA in its factored form on
    it, as the stored weight and each term's two factors in their own dtypes, merged on arrival by the
    op PEFT merges with (so the backward returns the factors' gradients, not a dense one); a
    kept-quantised weight as its codes and scales (bytes), then its LoRA factors."""

    def __init__(self, weight, factored, index: torch.Tensor, sends: list[int], recvs: list[int], link,
                 dtype: torch.dtype | None) -> None:
        self.weight, self.terms, self.like, self.pending = weight, None, [], []
        self.bytes, self.grad_bytes = 0, 0  # sent in the forward; their gradients return in the backward
        if isinstance(weight, QuantizedProjection):  # the codes travel, not dequantised weights
            stored = weight.weight.stored
            parts = [(stored.codes, None, True), (stored.scales, None, True)]
            parts += [(t, None, False) for lhs, rhs, _ in weight.terms for t in (lhs, rhs)]
        elif factored is not None:
            stored, self.terms = factored
            parts = [(t, None, False) for t in (stored, *(t for lhs, rhs, _ in self.terms for t in (lhs, rhs)))]
        else:
            parts = [(weight, dtype, False)]
        for tensor, cast, as_bytes in parts:
            sent = _pick(tensor, index, cast=cast)
            self.like.append((sent.dtype, tensor.shape[1:]))
            rows = sent.reshape(sent.shape[0], tensor.shape[1:].numel())  # one row per expert
            if as_bytes:  # codes and scales: any dtype crosses any backend
                rows = rows.contiguous().view(torch.uint8)
            self.bytes += rows.numel() * rows.element_size()
            self.grad_bytes += rows.numel() * rows.element_size() if rows.requires_grad else 0
            self.pending.append(comm.exchange(rows, recvs, sends, link.group, link.overlap, link.hooks))

    def wait(self, count: int):
        got = []
        for pending, (dtype, shape) in zip(self.pending, self.like, strict=True):
            rows = pending.wait()
            got.append((rows.view(dtype) if rows.dtype != dtype else rows).view(count, *shape))
        if self.terms is not None:  # W + scaling * lhs @ rhs per term, as PEFT's factored LoRA merges
            merged, factors = got[0], got[1:]
            with torch.autocast(merged.device.type, enabled=False):
                for i, (_, _, scaling) in enumerate(self.terms):
                    merged = torch.baddbmm(merged, factors[2 * i], factors[2 * i + 1], alpha=scaling)
            return merged
        if not isinstance(self.weight, QuantizedProjection):
            return got[0]
        codes, scales, *factors = got
        terms = [(factors[2 * i], factors[2 * i + 1], scaling) for i, (_, _, scaling) in enumerate(self.weight.terms)]
        return replace(self.weight, weight=self.weight.weight.with_experts(codes, scales), terms=terms)

    def received(self) -> list[torch.Tensor]:
        """What arrived that carries gradients back (a rank with no guest joins their exchange)."""
        return [p.wait() for p in self.pending]


def _pick(tensor: torch.Tensor, index: torch.Tensor, cast: torch.dtype | None) -> torch.Tensor:
    """``tensor[index]``, differentiable into ``tensor`` (:class:`_Lent`), cast to ``cast`` if given."""
    grad = tensor.requires_grad and torch.is_grad_enabled()
    if index.numel():
        sent = _Lent.apply(tensor, index) if grad else tensor.index_select(0, index)
    else:  # a leaf, so this rank's reverse all-to-all runs in backward too
        sent = tensor.new_empty((0, *tensor.shape[1:]), requires_grad=grad)
    return sent.to(cast) if cast is not None and sent.is_floating_point() else sent


@dataclass
class Guests:
    """This layer's lent weights in flight (per weight name) and how many experts this rank computes for others."""

    parts: dict[str, _Parts]
    count: int
    arrived: dict | None = None  # the weights as rebuilt, once for every chunk

    def weights(self) -> dict:
        if self.arrived is None:
            self.arrived = {n: p.wait(self.count) for n, p in self.parts.items()}
        return self.arrived

    def received(self) -> list[torch.Tensor]:
        return [t for p in self.parts.values() for t in p.received()]


class Lending:
    """One layer's balancing as its chunks' batches carry it into the holder's call.

    moves: whether any rank lends this layer (the same on every rank: all of them exchange weights, or
    none). sends / recvs: expert weights this rank sends to / receives from each rank (host ints).
    send_local: this rank's experts to send, destination-major. dtype: the autocast dtype the weights
    travel in. stats: the layer's DispatchStats (the lent bytes are added to it). The first chunk's call
    lends (:attr:`guests`), the later chunks reuse what it received.

    Not a dataclass on purpose: FSDP2's mixed precision copies every dataclass in a call's arguments
    (``dataclasses.replace``) to cast its tensors, and the chunks must share this one object."""

    __slots__ = ("num_local", "moves", "send_local", "sends", "recvs", "link", "dtype", "stats", "guests")

    def __init__(self, num_local: int, moves: bool, send_local: torch.Tensor, sends: list[int], recvs: list[int],
                 link, dtype: torch.dtype | None, stats) -> None:
        self.num_local, self.moves, self.send_local, self.sends, self.recvs = num_local, moves, send_local, sends, recvs
        self.link, self.dtype, self.stats = link, dtype, stats
        self.guests: Guests | None = None


def local_forward(module: nn.Module, batch: LocalBatch, layout: ExpertsLayout) -> torch.Tensor:
    """The holder's rows: its own experts' (``local_experts_forward``), then with ``batch.lending`` its
    guests' through the weights lent to it, which it receives here (module doc)."""
    lending = batch.lending
    if lending is None:
        return local_experts_forward(module, batch, layout)
    batch = replace(batch, lending=None)
    if lending.moves and lending.guests is None:  # every rank lends at its first chunk, or none does
        lending.guests = lend(module, layout, lending.send_local, lending.sends, lending.recvs, lending.link,
                              lending.dtype, batch.fp8_gemm)
        lending.stats.lent_bytes = sum(p.bytes for p in lending.guests.parts.values())
        lending.stats.lent_grad_bytes = sum(p.grad_bytes for p in lending.guests.parts.values())
    guests = lending.guests
    mine, theirs = split(batch, lending.num_local, guests.count if guests else 0)
    own = local_experts_forward(module, mine, layout)
    if guests is None:
        return own
    return torch.cat([own, guest_rows(module, layout, guests, theirs, own)])


def refusal(experts: nn.Module, holder: nn.Module | None) -> str | None:
    """Why ``runtime.balance`` cannot lend the experts of ``experts`` (its holder: ``holder``) yet, or None."""
    if holder is None:
        return f"{type(experts).__name__} is not an installed experts holder"
    name, layout = type(holder).__name__, installed.layout(holder)
    if layout.modules or layout.flat or layout.split:
        return f"{name} holds its experts as modules or flat or split weights; only stacked 3-D weights are lent"
    return None


def lend(holder: nn.Module, layout: ExpertsLayout, send_local: torch.Tensor, sends: list[int], recvs: list[int],
         link, dtype: torch.dtype | None, fp8: bool = False) -> Guests:
    """Start sending this rank's lent experts' weights (``send_local``, destination-major, ``sends[r]`` to
    rank ``r``) and receiving ``recvs[r]`` experts from each rank ``r``. ``dtype``: the autocast dtype a
    dense weight travels in (a weight under LoRA and its factors travel in their own dtypes, kept codes
    and scales as stored: :class:`_Parts`). ``fp8``:
    the call's runtime.fp8_gemm (the guests' GEMMs run as the owner's would)."""
    index = send_local[: sum(sends)]
    factored = {n: lora_factors(holder, n) for n in layout.roles}
    weights = local_weights(holder, layout, fp8, [n for n, f in factored.items() if f is None])
    return Guests({n: _Parts(weights.get(n), factored[n], index, sends, recvs, link, dtype) for n in layout.roles},
                  sum(recvs))


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
    if guests.count:
        return local_experts_forward(holder, batch, layout, weights=guests.weights())
    rows = own.new_zeros((0, own.shape[-1]))
    received = [w for w in guests.received() if w.requires_grad]
    return _Joined.apply(rows, *received) if received else rows
