"""Training helpers for a rewritten model."""

from __future__ import annotations

from torch import nn

from .runtime import gradients


def sync_gradients(model: nn.Module) -> None:
    """Apply the EP x DP gradient contract (see :mod:`hp_rewrite.runtime.gradients`) to a model
    rewritten by ``auto_patch`` / ``from_pretrained`` (it knows its EP group)."""
    info = getattr(model, "hp_rewrite", None)
    if info is None:
        raise ValueError("sync_gradients: this model was not rewritten by hp-rewrite (no model.hp_rewrite)")
    gradients.sync_gradients(model, info.ep)
