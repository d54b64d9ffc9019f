"""Token-deduplicated exchange: one row per (token, destination rank) instead of one per routed slot.

With top-k routing a token often has several experts on the same rank. The plain exchange sends it
once per slot and brings back one expert output per slot; here it travels once per rank, with its
side values there (the local ids of its experts on that rank, -1 elsewhere, and their routing
weights) packed into the same row (:func:`~.rows.pack_rows`: one all-to-all per direction, rows in
the hidden dtype). The owning rank runs each (row, expert) pair through the grouped GEMMs in the
same order as the plain path (expert-major, then source rank, token, slot), weights the outputs and
adds them per row in slot order, accumulated in the promoted dtype of (outputs, weights), and sends
back one partial per row, cast to the hidden dtype. The sending rank adds its partials over the
destination ranks in ascending rank order, in the promoted dtype. Every sum runs in a fixed order
(:mod:`.rows`), forward and backward: bf16 results are the same from run to run.

Everything here is differentiable where it must be: the weights travel inside the packed rows, so the
router gradient is computed where the expert outputs are and returns through the reverse exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import rows


@dataclass
class DedupRows:
    """One chunk's deduplicated send plan (before the split sizes are known on the host).

    hit: ``[n, ep]`` token t has at least one kept slot on rank r.
    order: flat ``r * n + t`` ids, every hit first in (rank, token) order, then the misses.
    per_rank: ``[ep]`` rows this chunk sends to each rank (the hits per rank).
    """

    hit: torch.Tensor
    order: torch.Tensor
    per_rank: torch.Tensor


def plan_rows(slots: torch.Tensor, num_local: int, ep_size: int) -> DedupRows:
    """``slots [n,K]``: placement slot of each routed slot (``ep_size * num_local`` for a dropped one)."""
    n = slots.shape[0]
    dest = torch.div(slots, num_local, rounding_mode="floor")  # ep_size for dropped slots
    hit = torch.zeros(n, ep_size + 1, dtype=torch.bool, device=slots.device).scatter_(1, dest, True)
    hit = hit[:, :ep_size]
    misses = (~hit).t().reshape(-1).to(torch.uint8)
    order = torch.sort(misses, stable=True).indices  # hits first, rank-major, token order kept
    return DedupRows(hit, order, hit.sum(0))


@dataclass
class SentRows:
    tokens: torch.Tensor  # [S] token (within the chunk) of each sent row
    weights: torch.Tensor  # [S, K] routing weights of the slots on the destination (0 elsewhere)
    local_ids: torch.Tensor  # [S, K] their local expert ids there (-1 elsewhere)
    combine_index: torch.Tensor  # [S] where each returned partial lands: token * fan + its place among them
    fan: int  # most destination ranks one token can have: min(K, ep)
    copies: torch.Tensor  # [n, fan] per token, its sent rows in destination order (rows.copy_table)


def sent_rows(
    plan: DedupRows, num_sent: int, slots: torch.Tensor, weights: torch.Tensor, num_local: int
) -> SentRows:
    """The ``num_sent`` rows of the chunk, their side values and where their partial sums go back."""
    n, top_k = slots.shape
    ep_size = plan.hit.shape[1]
    flat = plan.order[:num_sent]
    tokens = flat % n
    rank = torch.div(flat, n, rounding_mode="floor")
    token_slots = slots.index_select(0, tokens)
    here = torch.div(token_slots, num_local, rounding_mode="floor") == rank.unsqueeze(1)
    local_ids = torch.where(here, token_slots - rank.unsqueeze(1) * num_local, -1)
    fan = min(top_k, ep_size)
    position = plan.hit.cumsum(1) - 1  # the row's place among its token's destination ranks
    combine_index = tokens * fan + position[tokens, rank]
    copies = rows.copy_table(combine_index, n, fan)
    token_weights = rows.gather_rows(weights, tokens, copies)
    routed_weights = torch.where(here, token_weights, torch.zeros_like(token_weights))
    return SentRows(tokens, routed_weights, local_ids, combine_index, fan, copies)


@dataclass
class ReceivedPairs:
    """The (row, slot) pairs a rank's experts compute, for rows received with their side values."""

    pairs: torch.Tensor  # [P] flat row * K + k, expert-major (source rank, token, slot within an expert)
    rows: torch.Tensor  # [P] the row of each pair
    table: torch.Tensor  # [R, K] per row, its pairs by slot order (rows.copy_table)
    weights: torch.Tensor  # [P] each pair's routing weight (differentiable)


def received_pairs(weights: torch.Tensor, ids: torch.Tensor, num_local: int, num_pairs: int) -> ReceivedPairs:
    """The pairs of rows received with ``weights [R, K]`` and local ``ids [R, K]`` (-1: not here), in the
    order the plain path gives the experts their rows."""
    num_rows, top_k = ids.shape
    ids = ids.long()
    here = ids >= 0
    key = torch.where(here, ids, num_local).reshape(-1)
    pairs = torch.sort(key, stable=True).indices[:num_pairs]
    row_of = torch.div(pairs, top_k, rounding_mode="floor")
    width = top_k  # not min(K, local experts): a router may name one expert twice (a dropped slot)
    place = (here.cumsum(1) - 1).reshape(-1).index_select(0, pairs)  # the pair's place among its row's
    table = rows.copy_table(row_of * width + place, num_rows, width)
    return ReceivedPairs(pairs, row_of, table, weights.reshape(-1).index_select(0, pairs))


def weighted_partials(y: torch.Tensor, received: ReceivedPairs, weights_dtype: torch.dtype) -> torch.Tensor:
    """``[R, H]`` in ``y``'s dtype: per received row the sum of its experts' outputs times their weights,
    accumulated in the promoted dtype of (outputs, weights) in slot order, then cast to the hidden
    dtype to travel back (``y``: one output per pair, in the order of ``received.pairs``)."""
    dtype = torch.promote_types(y.dtype, weights_dtype)
    out = rows.weighted_row_sum(y, received.weights, received.table, received.rows, dtype)
    return out.to(y.dtype)


def sum_partials(partials: torch.Tensor, sent: SentRows, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n, H]`` in ``dtype``: each token's partial sums added over its destination ranks in ascending
    rank order."""
    hidden = partials.shape[-1]
    padded = partials.new_zeros((num_tokens * sent.fan, hidden)).index_copy_(0, sent.combine_index, partials)
    return padded.view(num_tokens, sent.fan, hidden).sum(1, dtype=dtype)
