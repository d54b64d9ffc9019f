"""Token-deduplicated exchange: one row per (token, destination rank) instead of one per routed slot.

With top-k routing a token often has several experts on the same rank. The plain exchange sends it
once per slot and brings back one expert output per slot; here it travels once per rank, with a
small side tensor naming its experts there (local ids, -1 where the slot is not on that rank) and
their routing weights. The owning rank runs each (row, expert) pair through the grouped GEMMs in the
same order as the plain path (expert-major, then source rank, token, slot), weights the outputs and
adds them per row (``index_add``, as transformers' own expert loop adds its outputs; on CUDA the
order of those adds follows atomics), and sends back one partial sum per row. The sending rank adds
its partials over the destination ranks in ascending rank order (a padded sum: deterministic).

Everything here is differentiable where it must be: the weights travel inside the side tensor, so the
router gradient is computed where the expert outputs are and returns through the reverse exchange.
The side tensor is float (ids < 2**24 are exact); for fp32 hidden states it rides in the same
exchange as the rows (extra columns), otherwise in a second exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def side_dtype(weights_dtype: torch.dtype) -> torch.dtype:
    """Float type of the side tensor: exact for the weights, and for local ids below 2**24."""
    return torch.promote_types(weights_dtype, torch.float32)


@dataclass
class SentRows:
    tokens: torch.Tensor  # [S] token (within the chunk) of each sent row
    side: torch.Tensor  # [S, 2K] routing weights on the destination (0 elsewhere), then local ids (-1)
    combine_index: torch.Tensor  # [S] where each returned partial lands in the padded [n * fan, H] sum
    fan: int  # most destination ranks one token can have: min(K, ep)


def sent_rows(
    plan: DedupRows, num_sent: int, slots: torch.Tensor, weights: torch.Tensor, num_local: int
) -> SentRows:
    """The ``num_sent`` rows of the chunk, their side tensor and where their partial sums go back."""
    n, top_k = slots.shape
    ep_size = plan.hit.shape[1]
    flat = plan.order[:num_sent]
    tokens = flat % n
    rank = torch.div(flat, n, rounding_mode="floor")
    token_slots = slots.index_select(0, tokens)
    here = torch.div(token_slots, num_local, rounding_mode="floor") == rank.unsqueeze(1)
    local_ids = torch.where(here, token_slots - rank.unsqueeze(1) * num_local, -1)
    token_weights = weights.index_select(0, tokens)
    routed_weights = torch.where(here, token_weights, torch.zeros_like(token_weights))
    dtype = side_dtype(weights.dtype)
    side = torch.cat([routed_weights.to(dtype), local_ids.to(dtype)], dim=1)
    fan = min(top_k, ep_size)
    position = plan.hit.cumsum(1) - 1  # the row's place among its token's destination ranks
    combine_index = tokens * fan + position[tokens, rank]
    return SentRows(tokens, side, combine_index, fan)


def pairs_of(side: torch.Tensor, top_k: int, num_local: int, num_pairs: int) -> torch.Tensor:
    """Flat ``row * K + k`` ids of the received (row, slot) pairs, expert-major (stable: source rank,
    token, slot within an expert, as the plain path orders them)."""
    ids = side[:, top_k:].detach().long().reshape(-1)
    key = torch.where(ids >= 0, ids, num_local)
    return torch.sort(key, stable=True).indices[:num_pairs]


def weighted_rows(
    y: torch.Tensor, pairs: torch.Tensor, side: torch.Tensor, top_k: int, weights_dtype: torch.dtype
) -> torch.Tensor:
    """``[R, H]``: per received row, the sum of its experts' outputs times their weights, in the promoted
    dtype of (outputs, weights) like the plain path's weighted sum. ``y``: one output per pair, in the
    order of ``pairs``. An index_add over the pairs (as transformers' own expert loop adds its outputs),
    so no padded ``[R, K, H]`` tensor is built: most of a row's K slots live on other ranks."""
    dtype = torch.promote_types(y.dtype, weights_dtype)
    w = side[:, :top_k].to(weights_dtype).reshape(-1).index_select(0, pairs).to(dtype)
    out = y.new_zeros((side.shape[0], y.shape[-1]), dtype=dtype)  # in place below: no second [R, H] copy
    return out.index_add_(0, torch.div(pairs, top_k, rounding_mode="floor"), y.to(dtype) * w.unsqueeze(1))


def sum_partials(partials: torch.Tensor, sent: SentRows, num_tokens: int) -> torch.Tensor:
    """``[n, H]``: each token's partial sums added over its destination ranks in ascending rank order."""
    hidden = partials.shape[-1]
    padded = partials.new_zeros((num_tokens * sent.fan, hidden)).index_copy_(0, sent.combine_index, partials)
    if sent.fan == 1:
        return padded
    return padded.view(num_tokens, sent.fan, hidden).sum(1)
