"""Which rows of a layer move to which rank (``runtime.balance: auto``), decided on the device.

Every rank gathers every rank's slot counts (one all-gather of ``E`` ints per layer, no host value)
and computes the same decision from them:

1. a rank's load is the rows its experts get from the whole group; the target is the mean (rounded
   up). When the busiest rank is under ``balance_threshold`` times the mean, nothing moves;
2. the ranks over the target, busiest first, give their excess away from their hottest experts first
   (fewest experts copied for the rows moved), and the ranks under it, idlest first, take it, each up
   to its deficit (the north-west corner of a transport table: each piece is one expert's rows to one
   helper);
3. a piece smaller than ``balance_min_rows`` stays home (its weights would cost more on the wire than
   its rows cost to compute), and a helper takes at most ``balance_replicas`` pieces;
4. each expert's rows, taken in source-rank order, are cut at those amounts: the first stay with the
   owner, the next go to each helper in rank order.

A row's destination is then a *virtual slot* ``rank * width + local`` where ``width = local experts +
balance_replicas``: a helper's guests follow its own experts, in slot order. The exchanges run on
virtual slots as they run on placement slots, so the per-slot and deduplicated exchanges, chunks and
capacity (decided before, on the experts' ids) need nothing else. Which rows a rank computes never
changes what a row's expert computes: results are the unbalanced ones (the sums over a token's slots
keep their order; an expert's weight gradient adds its copies' gradients, :mod:`.replicas`).

Activation checkpointing's recomputation sees the same counts (its routing replayed), so it makes the
same decision. Sizes the host needs (weights to send and receive, whether anything moves) are read
with the layer's split sizes, in its one host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..options import RuntimeOptions
from ..transport.comm import gather_counts


@dataclass
class Decision:
    """One layer's balancing, on the device until the layer's host read.

    slots: ``[T, K]`` virtual slot of each routed slot (``ep * width`` for a dropped one).
    width: virtual slots per rank (local experts, then ``replicas`` guest slots).
    sends / recvs: ``[ep]`` expert weights this rank sends to / receives from each rank.
    send_local: ``[ep * local]`` this rank's local experts to send, destination-major (the first
        ``sum(sends)`` are meant).
    moved: ``[1]`` guest experts over the whole group (the same on every rank): 0 when nothing moves.
    """

    slots: torch.Tensor
    width: int
    sends: torch.Tensor
    recvs: torch.Tensor
    send_local: torch.Tensor
    moved: torch.Tensor

    def host_values(self) -> list[torch.Tensor]:
        """The int64 values the layer's one host read brings along: sends, recvs, moved."""
        return [self.sends, self.recvs, self.moved]


def _overlap(hi_a: torch.Tensor, lo_a: torch.Tensor, hi_b: torch.Tensor, lo_b: torch.Tensor) -> torch.Tensor:
    """Length of the intersection of intervals ``[lo_a, hi_a)`` and ``[lo_b, hi_b)`` (broadcast)."""
    return (torch.minimum(hi_a, hi_b) - torch.maximum(lo_a, lo_b)).clamp(min=0)


def moves(per_slot: torch.Tensor, ep: int, options: RuntimeOptions) -> torch.Tensor:
    """``[E, ep]``: the rows of each slot's expert that go to each helper rank."""
    num_local = per_slot.shape[0] // ep
    per_rank = per_slot.view(ep, num_local)
    load = per_rank.sum(1)
    total = load.sum()
    target = torch.div(total + ep - 1, ep, rounding_mode="floor")
    over = load.max().double() * ep > options.balance_threshold * total.double()
    givers = torch.sort(load, descending=True, stable=True).indices  # the busiest rank gives first
    takers = torch.sort(load, stable=True).indices  # to the idlest first
    excess = ((load - target).clamp(min=0) * over).index_select(0, givers)
    deficit = (target - load).clamp(min=0).index_select(0, takers)
    hot = torch.sort(per_rank.index_select(0, givers), dim=1, descending=True, stable=True)  # hottest experts first
    ends = hot.values.cumsum(1)
    give = _overlap(ends, ends - hot.values, excess.unsqueeze(1), torch.zeros_like(ends)).reshape(-1)
    give_end, take_end = give.cumsum(0), deficit.cumsum(0)
    moved = _overlap(give_end.unsqueeze(1), (give_end - give).unsqueeze(1), take_end.unsqueeze(0),
                     (take_end - deficit).unsqueeze(0))  # [pieces in giving order, helpers in taking order]
    moved = moved * (moved >= options.balance_min_rows)
    moved = moved * ((moved > 0).cumsum(0) <= options.balance_replicas)  # a helper's first pieces
    slot_of_piece = (givers.unsqueeze(1) * num_local + hot.indices).reshape(-1)
    return moved.index_select(0, torch.argsort(slot_of_piece)).index_select(1, torch.argsort(takers))


def decide(slots: torch.Tensor, per_slot: torch.Tensor, group: dist.ProcessGroup, rank: int,
           options: RuntimeOptions) -> Decision:
    """The layer's balancing from ``slots [T, K]`` (placement slots; ``E`` when dropped) and this rank's
    slots per placement slot ``per_slot [E]`` (what the dispatch counted for its statistics)."""
    return assign(slots, gather_counts(per_slot, group), rank, options)  # [ep, E]: every rank's counts


def assign(slots: torch.Tensor, counts: torch.Tensor, rank: int, options: RuntimeOptions) -> Decision:
    """This rank's part of the decision, from every rank's slot counts ``counts [ep, E]``."""
    ep, num_slots = counts.shape
    num_local, device, flat = num_slots // ep, slots.device, slots.reshape(-1)
    moved = moves(counts.sum(0), ep, options)
    kept = counts.sum(0) - moved.sum(1)
    amounts = torch.cat([kept.unsqueeze(1), moved], dim=1)  # [E, 1 + ep]: owner, then each helper
    bounds = amounts.cumsum(1)
    before = counts.cumsum(0) - counts  # rows of each expert from lower source ranks
    lo, hi = before[rank].unsqueeze(1), (before[rank] + counts[rank]).unsqueeze(1)
    mine_to = _overlap(hi, lo, bounds, bounds - amounts)  # [E, 1 + ep]: my rows of each expert, per destination
    # my rows sorted by slot (dropped last) are cut, in order, by mine_to: each one's (slot, destination)
    order = torch.sort(flat, stable=True).indices
    cell = torch.searchsorted(mine_to.reshape(-1).cumsum(0), torch.arange(flat.numel(), device=device), right=True)
    slot, dest = torch.div(cell, ep + 1, rounding_mode="floor").clamp(max=num_slots - 1), cell % (ep + 1)
    width = num_local + options.balance_replicas
    guest = (moved > 0).cumsum(0) - 1  # [E, ep]: a helper's guests in slot order
    helper = (dest - 1).clamp(min=0)
    home = torch.div(slot, num_local, rounding_mode="floor") * width + slot % num_local
    away = helper * width + num_local + guest[slot, helper]
    virtual = torch.where(dest == 0, home, away)
    virtual = torch.where(cell >= num_slots * (ep + 1), torch.full_like(virtual, ep * width), virtual)
    out = torch.empty_like(flat)
    out[order] = virtual
    lent = moved[rank * num_local : (rank + 1) * num_local] > 0  # [local, ep]: my experts each helper takes
    send_local = torch.argsort((~lent).t().reshape(-1).to(torch.uint8), stable=True) % num_local
    recvs = (moved[:, rank] > 0).view(ep, num_local).sum(1)
    return Decision(out.view_as(slots), width, lent.sum(0), recvs, send_local,
                    (moved > 0).sum().reshape(1))
