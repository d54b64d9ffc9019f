"""Ascend's token permutation ops, used only where they are exactly the torch path's reordering.

``npu_moe_token_permute(tokens, indices)`` sorts rows stably by expert id and returns the order it used
(``sorted_indices``, int32); ``npu_moe_token_unpermute(rows, sorted_indices)`` puts rows back (both have
a backward; ``../shared/reference/ascend-kernels.md``). With one index per row (K = 1) and no probs each
is a bijection, forward and backward, so the result is bit for bit the torch ``index_select`` it
replaces. The runtime uses them for the per-slot exchange's expert-major regrouping of received rows,
the return to source order, and the dropless un-sort before the weighted combine.

Kept in torch, because the NPU op would not give the same bits: the send-side gather (a token copied
to its K slots: the backward sums K gradients, in the kernel's order rather than torch's), the
weighted combine (``unpermute`` with probs multiplies and sums where the torch path does one batched
matmul in the promoted dtype), the deduplicated exchange (one row serves several local experts), and
routing (``npu_moe_gating_top_k`` is not confirmed to select exactly as transformers' routers).
"""

from __future__ import annotations

import torch

from . import npu


def wanted(requested: str, device_type: str) -> bool:
    """Whether the exchange reorders rows with the NPU ops: ``compute: npu`` (where torch_npu imports,
    also for CPU tensors: a stand-in), or ``auto`` on an NPU device."""
    return (requested == "npu" or (requested == "auto" and device_type == "npu")) and npu.available()


def sort_by_expert(rows: torch.Tensor, expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` stably sorted by ``expert`` (one id per row), and the order for :func:`unsort`."""
    import torch_npu  # noqa: PLC0415 - optional dependency, imported on use only

    return torch_npu.npu_moe_token_permute(rows, expert.reshape(-1, 1).to(torch.int32))


def unsort(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of ``rows`` back to position ``order[i]`` (``order``: a permutation)."""
    import torch_npu  # noqa: PLC0415

    return torch_npu.npu_moe_token_unpermute(rows, order.to(torch.int32))
