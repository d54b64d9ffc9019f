"""Loading checkpoints expert-parallel: only this rank's experts are read (:mod:`.local`), and
``from_pretrained`` / ``auto_patch`` return rewritten models (:mod:`.patch`).

Tiny random-weight models are :mod:`hp_rewrite.tiny`; config shrinking is :mod:`hp_rewrite.hf.shrink`.
"""

from .local import CheckpointKeyError, load_expert_parallel

__all__ = ["CheckpointKeyError", "load_expert_parallel"]
