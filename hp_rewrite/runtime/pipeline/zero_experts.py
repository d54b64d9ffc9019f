"""Zero-computation (identity) experts: ids at or above the routed-expert count (LongCat-Flash).

Such a holder keeps ``num_experts`` FFN experts and ``Z`` more ids whose output is the token itself,
weighted: ``w * x``. Their rows are never dispatched: :func:`split_zero_experts` (called by
:func:`~.dispatch.dispatch`) takes their weighted sum on the sending rank, where the token already is,
and hands the exchange the other slots only (a zero slot becomes the drop sentinel ``num_experts``
with weight 0, as capacity drops a slot). The token's zero-expert weights are summed first and multiply
it once, in the promoted dtype of (hidden, weights), and the result is added to the combined routed
output (the original adds each ``x * w`` separately: the same value up to rounding).
"""

from __future__ import annotations

import torch


def split_zero_experts(
    hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices, weights, identity)``: the routing with every zero-expert slot (id ``>= num_experts``)
    turned into the sentinel ``num_experts`` with weight 0, and ``sum_k w[t,k] * hidden[t]`` over those
    slots ``[T, H]``. The router gradient of a zero slot flows through ``identity`` only."""
    zero = indices >= num_experts
    zero_weights = torch.where(zero, weights, torch.zeros_like(weights))
    # (sum_k w) * x, not sum_k (w * x): the same value without a [T, K, H] temporary on the hot path
    identity = zero_weights.sum(dim=1, keepdim=True) * hidden
    indices = torch.where(zero, torch.full_like(indices, num_experts), indices)
    weights = torch.where(zero, torch.zeros_like(weights), weights)
    return indices, weights, identity
