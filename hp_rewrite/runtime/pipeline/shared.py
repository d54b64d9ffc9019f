"""Merging the routed output with a shared expert.

``none``: routed. ``additive``: routed + shared (DeepSeek, GLM). ``gated``: routed +
sigmoid(gate_logits) * shared, with ``gate_logits = Linear(H, 1)(x)`` (Qwen2-MoE line). ``scaled``:
routed * scale + shared (routed scaling factor applied in the block, e.g. Laguna, Step3p7).
"""

from __future__ import annotations

from typing import Literal

import torch

from ..errors import ExpertParallelError

SharedMode = Literal["none", "additive", "gated", "scaled"]
SHARED_MODES: tuple[str, ...] = ("none", "additive", "gated", "scaled")


def merge_shared(
    routed: torch.Tensor,
    shared: torch.Tensor | None = None,
    mode: SharedMode = "none",
    *,
    gate_logits: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Combine routed and shared outputs (same shape) the way the original block does."""
    if mode == "none":
        return routed
    if shared is None:
        raise ExpertParallelError(f"shared merge {mode!r} needs the shared expert output")
    if mode == "additive":
        return routed + shared
    if mode == "gated":
        if gate_logits is None:
            raise ExpertParallelError("shared merge 'gated' needs the shared gate logits")
        return routed + torch.sigmoid(gate_logits) * shared
    if mode == "scaled":
        if scale is None:
            raise ExpertParallelError("shared merge 'scaled' needs the routed scale")
        return routed * scale + shared
    raise ExpertParallelError(f"shared merge {mode!r}: choose one of {', '.join(SHARED_MODES)}")
