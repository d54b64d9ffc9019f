"""Archetype templates: ordinary Python forwards that the code generator specialises per model.

Installed as ``hp_rewrite.archetypes``. Templates call only the public API of ``hp_rewrite.runtime``.
"""
