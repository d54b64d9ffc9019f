"""The one rule for "too big to probe": which MoE blocks are confirmed by executing a copy of them.

Confirming an archetype runs a random-weight copy of one block (:mod:`hp_rewrite.match.archetype`).
For a block with more than :data:`PROBE_LIMIT_PARAMS` parameters, ``describe-moe`` and ``cost``
confirm the archetype on the same block classes built from a shrunk copy of the config instead
(:func:`hp_rewrite.hf.shrink.tiny_config`), and read only the sizes from the full model.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

#: Blocks with more parameters than this are not materialised to confirm their archetype.
PROBE_LIMIT_PARAMS = 20_000_000


def largest_block_params(blocks: Iterable[nn.Module]) -> int:
    """The parameter count of the largest of ``blocks`` (0 for none); meta tensors count too."""
    return max((sum(p.numel() for p in block.parameters()) for block in blocks), default=0)


def too_big_to_probe(params: int) -> bool:
    """Whether a block of ``params`` parameters is confirmed on a shrunk copy instead of itself."""
    return params > PROBE_LIMIT_PARAMS
