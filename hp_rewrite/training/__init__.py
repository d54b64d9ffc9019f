"""Training a rewritten model: gradient synchronisation for hand-written loops, and the engines.

A model rewritten by ``auto_patch`` / ``from_pretrained`` is exact inside ``DistributedDataParallel``
as built by the user, transformers ``Trainer`` or accelerate (see :mod:`hp_rewrite.sync.engines`).
Without DDP, ``sync_gradients`` (after backward) or ``gradient_sync`` (during it) apply the same
contract (:mod:`.rewritten`). ``prepare_trainer`` makes a ``Trainer`` save and resume the rank-local
experts. See docs/training.md. The names below load their module on first use (torch, transformers,
accelerate stay unimported until then).
"""

from __future__ import annotations

_LAZY = {
    "sync_gradients": "rewritten",
    "gradient_sync": "rewritten",
    "fully_shard": "fsdp",
    "clip_grad_norm_": "fsdp",
    "load_fully_sharded": "sharded_load",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "prepare_trainer": "trainer",
    "prepare_accelerator": "accelerator",
    "routing_stats": "routing",
    "track_routing": "routing",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
