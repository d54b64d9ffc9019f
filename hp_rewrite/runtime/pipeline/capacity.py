"""Capacity limit: each expert keeps at most ``capacity`` routed slots of this rank's tokens.

Applied to the routing decisions before any dispatch, so every code path (one-call, two-phase,
chunked, sync or async, any ep) drops exactly the same slots. Dropped slots get expert id
``num_experts`` (a sentinel that is never dispatched) and weight 0; slots that hold it already (zero
experts', see :mod:`.zero_experts`) stay as they are and count for no expert.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import torch

from ..errors import ExpertParallelError


class CapacityResult(NamedTuple):
    indices: torch.Tensor  # [T,K]; dropped slots hold num_experts
    weights: torch.Tensor  # [T,K]; dropped slots hold 0
    dropped: torch.Tensor  # [E] int64, dropped slots per expert (stays on device: no host sync)


def count_per_expert(flat_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots per expert id in ``[0, num_experts)``; ids >= num_experts (dropped) are not counted.

    A scatter-add instead of ``bincount``, which syncs with the host on CUDA to size its output.
    """
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat_indices.device)
    counts.scatter_add_(0, flat_indices.clamp(max=num_experts), torch.ones_like(flat_indices))
    return counts[:num_experts]


def _decimal_ratio(capacity_factor: float) -> tuple[int, int]:
    """The factor as the decimal the user wrote (1.1 is 11/10, not its binary neighbour), in ints.

    torch.compile traces this on the Python float (a constant of the graph), so no decorator is needed,
    and none is wanted: ``torch.compiler.assume_constant_result`` imports torch._dynamo (1.4 s) at import.
    """
    exact = Fraction(str(capacity_factor))
    return exact.numerator, exact.denominator


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots one expert accepts from one rank: ``ceil(capacity_factor * tokens * top_k / num_experts)``."""
    num, den = _decimal_ratio(capacity_factor)
    return -(-(num * num_tokens * top_k) // (den * num_experts))  # exact ceil in ints


def apply_capacity(
    indices: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    capacity_factor: float,
    policy: str = "probs",
    renormalize: bool = False,
) -> CapacityResult:
    """Drop the slots beyond each expert's capacity.

    policy ``probs`` keeps each expert's highest-weight slots, ``position`` its earliest tokens; ties
    go to the earlier (token, slot) position, so the kept set is deterministic. With ``renormalize``
    each token's kept weights are rescaled to the total weight the token had before dropping (tokens
    whose kept weights sum to 0, e.g. every slot dropped, keep weight 0: residual only).
    """
    if policy not in ("probs", "position"):
        raise ExpertParallelError(f"drop_policy={policy!r}: choose probs or position")
    num_tokens, top_k = indices.shape
    cap = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    flat_idx = indices.reshape(-1)
    if policy == "position":
        order = torch.sort(flat_idx, stable=True).indices
    else:
        by_weight = torch.sort(weights.detach().reshape(-1).float(), descending=True, stable=True).indices
        order = by_weight[torch.sort(flat_idx[by_weight], stable=True).indices]
    counts = count_per_expert(flat_idx, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    starts = torch.cat([starts, starts.new_zeros(1)])  # slots that hold the sentinel already (zero experts')
    sorted_idx = flat_idx[order].clamp(max=num_experts)
    rank_in_expert = torch.arange(flat_idx.numel(), device=flat_idx.device) - starts[sorted_idx]
    keep = torch.empty_like(flat_idx, dtype=torch.bool)
    keep[order] = rank_in_expert < cap
    keep = keep.view_as(indices)
    new_indices = torch.where(keep, indices, torch.full_like(indices, num_experts))
    new_weights = torch.where(keep, weights, torch.zeros_like(weights))
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        kept = new_weights.sum(dim=-1, keepdim=True)
        has_kept = kept != 0
        scale = torch.where(has_kept, total / torch.where(has_kept, kept, torch.ones_like(kept)), 0.0)
        new_weights = new_weights * scale.to(new_weights.dtype)
    dropped = counts - counts.clamp(max=cap)
    return CapacityResult(new_indices, new_weights, dropped)
