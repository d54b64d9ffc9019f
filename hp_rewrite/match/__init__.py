"""Structural matching of MoE blocks to archetypes (confirmed by execution)."""

from .archetype import Archetype, MatchResult, choose_archetype, layout_name, materialize
from .structure import BlockStructure, analyze_block, experts_layout, find_blocks, find_experts_holders

__all__ = [
    "Archetype",
    "BlockStructure",
    "MatchResult",
    "analyze_block",
    "choose_archetype",
    "experts_layout",
    "find_blocks",
    "find_experts_holders",
    "layout_name",
    "materialize",
]
