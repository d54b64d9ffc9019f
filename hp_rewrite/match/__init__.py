"""Structural matching of MoE blocks to archetypes (confirmed by execution)."""

from .archetype import Archetype, MatchResult, choose_archetype, layout_name, materialize
from .registry import ArchetypeSpec, Probe, load_extensions, register_archetype
from .structure import BlockStructure, analyze_block, experts_layout, find_blocks, find_experts_holders

__all__ = [
    "Archetype",
    "ArchetypeSpec",
    "BlockStructure",
    "MatchResult",
    "Probe",
    "analyze_block",
    "choose_archetype",
    "experts_layout",
    "find_blocks",
    "find_experts_holders",
    "layout_name",
    "load_extensions",
    "materialize",
    "register_archetype",
]
