"""Routing applied to the experts' input (Llama 4): one row per (token, expert) slot, combined with weight 1.

A block whose experts take no routing scales each token by its router score *before* the experts and
sums their outputs. :func:`dispatch_input_scaled` sends ``score[t, k] * hidden[t]`` to expert
``indices[t, k]`` (the product taken on the sending rank, in the hidden dtype, as the original takes
it), as ``T*K`` single-slot rows through the ordinary :func:`~.dispatch.dispatch` with weight 1;
:func:`combine_input_scaled` runs the local experts, brings the rows back and sums each token's ``K``
slots. The router gradient flows through the scaled input, exactly as in the original block.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import RoutedDispatch, dispatch, experts_and_combine
from .layer import ExpertParallelBinding


def dispatch_input_scaled(
    hidden: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor, *, binding: ExpertParallelBinding
) -> RoutedDispatch:
    """Start the exchange of ``scores[t, k] * hidden[t]`` to expert ``indices[t, k]`` (``[T, K]``)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    rows = hidden.unsqueeze(1) * scores.unsqueeze(-1).to(hidden.dtype)  # [T, K, H]
    slots = indices.reshape(-1, 1)
    ones = torch.ones(slots.shape, dtype=scores.dtype, device=scores.device)
    return dispatch(rows.reshape(-1, hidden.shape[-1]), slots, ones, binding=binding)


def combine_input_scaled(state: RoutedDispatch, experts: nn.Module, top_k: int) -> torch.Tensor:
    """The local experts on the received rows, the rows back, each token's ``top_k`` slots summed: ``[T, H]``."""
    out = experts_and_combine(state, experts)
    return out.reshape(-1, top_k, out.shape[-1]).sum(dim=1)
