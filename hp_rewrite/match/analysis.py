"""Analysis: the MoE blocks a plan selects, each with an execution-confirmed archetype.

``analyze`` finds every experts holder by structure, skips the blocks the plan excludes and confirms
one archetype per block class (the plan's ``extensions:`` first, then the built-in ones), or says why
none fits. With ``collect_errors`` it records failures instead of raising, for ``describe-moe``.
``expert_placement`` says which experts a rank keeps under the plan's ``placement``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..runtime.errors import ExpertParallelError
from ..runtime.group.groups import ExpertParallelGroup, ExpertPlacement
from .archetype import MatchResult, choose_archetype
from .structure import BlockStructure, analyze_block, experts_layout, find_blocks, find_experts_holders


def recorded_router_classes(model: nn.Module) -> set[type]:
    """Classes whose outputs the model records (``_can_record_outputs``), e.g. routers for the aux loss."""
    classes: set[type] = set()
    for m in model.modules():
        for target in (getattr(m, "_can_record_outputs", None) or {}).values():
            cls = getattr(target, "target_class", target)
            if isinstance(cls, type):
                classes.add(cls)
    return classes


@dataclass(frozen=True)
class AnalysisFailure:
    """An experts holder whose block structure could not be analysed (``analyze(collect_errors=True)``)."""

    path: str  # the experts holder's module path
    holder: nn.Module
    reason: str


@dataclass
class Analysis:
    matched: list[MatchResult]
    unmatched: list[MatchResult]
    excluded: list[str]
    failed: list[AnalysisFailure] = field(default_factory=list)  # only with collect_errors=True


def _blocks_collecting(model: nn.Module, failed: list[AnalysisFailure]) -> list[BlockStructure]:
    """:func:`find_blocks`, recording a holder whose structure analysis raises instead of raising."""
    blocks = []
    for path, holder in find_experts_holders(model):
        parent_path, _, attr = path.rpartition(".")
        try:
            if experts_layout(holder).split:  # the block holds its experts itself
                blocks.append(analyze_block(path, holder, ""))
                continue
            blocks.append(analyze_block(parent_path, model.get_submodule(parent_path) if parent_path else model, attr))
        except Exception as e:  # noqa: BLE001 - recorded, the caller asked for a diagnosis
            failed.append(AnalysisFailure(path, holder, f"the structure analysis raised {type(e).__name__}: {e}"))
    return blocks


def analyze(model: nn.Module, plan, *, collect_errors: bool = False) -> Analysis:
    """Match every MoE block the plan selects; one execution-confirmed archetype per block class.

    ``collect_errors``: a holder whose structure analysis raises is recorded in ``failed`` and a block
    class whose archetype probe raises is unmatched with the exception as its reason (describe-moe),
    instead of raising.

    The plan's ``extensions:`` modules are imported first; the archetypes they register are tried
    before the built-in ones (a module that cannot be imported or registers nothing is a PlanError)."""
    from .registry import load_extensions

    extensions = load_extensions(plan.extensions)
    forced = {"router": plan.archetype.router, "shared": plan.archetype.shared, "level": plan.archetype.level,
              "router_dtype": plan.runtime.router_dtype}
    recorded = recorded_router_classes(model)
    by_class: dict[tuple, MatchResult] = {}
    matched, unmatched, excluded = [], [], []
    failed: list[AnalysisFailure] = []
    for s in _blocks_collecting(model, failed) if collect_errors else find_blocks(model):
        if not (plan.matches(s.path, type(s.block).__name__) or plan.matches(s.experts_path, type(s.experts).__name__)):
            excluded.append(s.path)
            continue
        key = (type(s.block), s.experts_name, type(s.experts))
        if key not in by_class:
            router = s.block.get_submodule(s.router_name) if s.router_name else None
            try:
                with torch.device("cpu"):  # the probe runs real tiny tensors, even under a meta-device context
                    by_class[key] = choose_archetype(s, forced, recorded_router=type(router) in recorded,
                                                     extensions=extensions)
            except Exception as e:  # noqa: BLE001
                if not collect_errors:
                    raise
                by_class[key] = MatchResult(s, None, f"the archetype probe raised {type(e).__name__}: {e}")
        first = by_class[key]
        result = MatchResult(s, first.archetype, first.reason, first.tried, first.probe_width)
        (matched if result.archetype else unmatched).append(result)
        if result.archetype and plan.placement.strategy == "balanced" and s.num_experts % plan.ep_size == 0:
            # a profile that does not fit the model fails here, before any rank is launched
            expert_placement(plan, s, ExpertParallelGroup(size=plan.ep_size))
    return Analysis(matched, unmatched, excluded, failed)


def expert_placement(plan, s: BlockStructure, ep: ExpertParallelGroup) -> ExpertPlacement:
    """This rank's experts of block ``s`` under the plan's ``placement`` section."""
    loads = plan.placement.loads_for(s.path)
    if plan.placement.strategy == "contiguous":
        return ExpertPlacement(s.num_experts, ep.size, ep.rank)
    if loads is None:
        raise ExpertParallelError(
            f"placement: the routing loads have no entry for the MoE block {s.path}; record them on this "
            "model with `hp-rewrite profile` (same model and plan), or use strategy: contiguous"
        )
    if len(loads) != s.num_experts:
        raise ExpertParallelError(
            f"placement: the routing loads of {s.path} count {len(loads)} experts, the block has "
            f"{s.num_experts}; the profile was recorded on another model"
        )
    if ep.size == 1:
        return ExpertPlacement(s.num_experts, 1, 0)
    return ExpertPlacement.balanced(loads, ep.size, ep.rank)
