"""Training helpers for a rewritten model."""

from __future__ import annotations

from torch import nn

from .runtime import gradients


def sync_gradients(model: nn.Module) -> None:
    """Apply the EP x DP gradient contract (see :mod:`hp_rewrite.runtime.gradients`) to a model
    rewritten by ``auto_patch`` / ``from_pretrained`` (it knows its EP group)."""
    gradients.sync_gradients(model, _ep_of(model, "sync_gradients"))


def _ep_of(model: nn.Module, what: str):
    info = getattr(model, "hp_rewrite", None)
    if info is None:
        raise ValueError(f"{what}: this model was not rewritten by hp-rewrite (no model.hp_rewrite)")
    return info.ep


def gradient_sync(model: nn.Module) -> gradients.GradientSync:
    """The same contract as :func:`sync_gradients`, overlapped with backward (see
    :class:`hp_rewrite.runtime.gradients.GradientSync`): create once, call ``.wait()`` after every
    ``backward()``."""
    return gradients.GradientSync(model, _ep_of(model, "gradient_sync"))
