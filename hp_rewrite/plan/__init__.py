"""The plan layer: a versioned YAML file saying how to run a model expert-parallel.

``load_plan(path)`` / ``parse_plan(text)`` return a frozen, validated :class:`Plan` or raise
:class:`PlanError` with ``file:line: field.path: what is wrong``. Reading a plan never imports
torch or any user code; the format is described in ``docs/plan-format.md``.
"""

from .loader import load_plan, parse_plan
from .schema import (
    DEFAULT_PLAN,
    PLAN_VERSION,
    ArchetypeSection,
    ContextSection,
    ModulesSection,
    OutputSection,
    PlacementSection,
    Plan,
    PlanError,
    Problem,
    RoutingSection,
    RuntimeSection,
)

__all__ = [
    "DEFAULT_PLAN",
    "PLAN_VERSION",
    "ArchetypeSection",
    "ModulesSection",
    "ContextSection",
    "OutputSection",
    "PlacementSection",
    "Plan",
    "PlanError",
    "Problem",
    "RoutingSection",
    "RuntimeSection",
    "load_plan",
    "parse_plan",
]
