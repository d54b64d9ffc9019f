"""From a model and a plan to installed expert-parallel forwards.

``analyze`` finds the MoE blocks the plan selects and confirms an archetype per block class;
``generate`` writes the artifact (generated module, manifest, diff); ``install`` makes a model with
real weights expert-parallel from an artifact, without re-running the analysis.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .codegen import Artifact, GeneratedFunction, import_artifact, write_artifact
from .codegen.artifacts import find_current
from .match import MatchResult, choose_archetype, find_blocks
from .match.archetype import block_source, experts_source
from .match.structure import BlockStructure
from .runtime import (
    ExpertParallelError,
    ExpertParallelGroup,
    ExpertPlacement,
    RuntimeOptions,
    install_expert_parallel,
)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def recorded_router_classes(model: nn.Module) -> set[type]:
    """Classes whose outputs the model records (``_can_record_outputs``), e.g. routers for the aux loss."""
    classes: set[type] = set()
    for m in model.modules():
        for target in (getattr(m, "_can_record_outputs", None) or {}).values():
            cls = getattr(target, "target_class", target)
            if isinstance(cls, type):
                classes.add(cls)
    return classes


@dataclass
class Analysis:
    matched: list[MatchResult]
    unmatched: list[MatchResult]
    excluded: list[str]


def analyze(model: nn.Module, plan) -> Analysis:
    """Match every MoE block the plan selects; one execution-confirmed archetype per block class."""
    if plan.extensions:
        raise ExpertParallelError(
            f"extensions {plan.extensions}: user archetype extensions are not loaded by this version of "
            "hp-rewrite; remove the extensions: list (see docs/plan-format.md, Extension point)"
        )
    forced = {"router": plan.archetype.router, "shared": plan.archetype.shared, "level": plan.archetype.level,
              "router_dtype": plan.runtime.router_dtype}
    recorded = recorded_router_classes(model)
    by_class: dict[tuple, MatchResult] = {}
    matched, unmatched, excluded = [], [], []
    for s in find_blocks(model):
        if not (plan.matches(s.path, type(s.block).__name__) or plan.matches(s.experts_path, type(s.experts).__name__)):
            excluded.append(s.path)
            continue
        key = (type(s.block), s.experts_name, type(s.experts))
        if key not in by_class:
            router = getattr(s.block, s.router_name) if s.router_name else None
            by_class[key] = choose_archetype(s, forced, recorded_router=type(router) in recorded)
        first = by_class[key]
        result = MatchResult(s, first.archetype, first.reason, first.tried, first.probe_width)
        (matched if result.archetype else unmatched).append(result)
        if result.archetype and plan.placement.strategy == "balanced" and s.num_experts % plan.ep_size == 0:
            # a profile that does not fit the model fails here, before any rank is launched
            expert_placement(plan, s, ExpertParallelGroup(size=plan.ep_size))
    return Analysis(matched, unmatched, excluded)


def generated_functions(analysis: Analysis) -> list[GeneratedFunction]:
    """One function per patched class, in a deterministic order."""
    funcs: dict[type, GeneratedFunction] = {}
    for r in analysis.matched:
        experts_cls = type(r.structure.experts)
        if experts_cls not in funcs:
            arch = {"level": "experts", "router": "model", "shared": "model", "layout": r.archetype.layout}
            funcs[experts_cls] = GeneratedFunction(experts_cls, f"{experts_cls.__name__}_forward",
                                                   experts_source(experts_cls.__name__), arch)
        block_cls = type(r.structure.block)
        if r.archetype.level == "block" and block_cls not in funcs:
            funcs[block_cls] = GeneratedFunction(block_cls, f"{block_cls.__name__}_forward",
                                                 block_source(block_cls.__name__, r.archetype), r.archetype.as_dict())
    return sorted(funcs.values(), key=lambda f: f.function_name)


def write(analysis: Analysis, plan, config, out_dir: Path) -> Artifact:
    return write_artifact(generated_functions(analysis), plan.hash(), config, config.model_type, out_dir)


def generate(model: nn.Module, plan, config, out_dir: Path) -> tuple[Analysis, Artifact]:
    analysis = analyze(model, plan)
    return analysis, write(analysis, plan, config, out_dir)


def ensure_artifact(model: nn.Module, plan, config, out_dir: Path) -> Artifact:
    """The current artifact for these inputs, generating it only when none exists.

    Reusing skips the analysis, whose execution probe materialises one block with random weights:
    ranks that load after rank 0 (or after ``hp-rewrite apply``) never pay that memory.
    """
    return find_current(Path(out_dir), plan.hash(), config) or write(analyze(model, plan), plan, config, out_dir)


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


def install(model: nn.Module, artifact: Artifact, plan, ep: ExpertParallelGroup,
            options: RuntimeOptions | None = None, shard: bool = True) -> list[str]:
    """Install the artifact's forwards on ``model`` (real weights). Returns the patched block paths."""
    module = import_artifact(artifact)
    classes = artifact.manifest["classes"]
    options = options or plan.runtime.to_options()
    patched = []
    for s in find_blocks(model):
        if not (plan.matches(s.path, type(s.block).__name__) or plan.matches(s.experts_path, type(s.experts).__name__)):
            continue
        entry = classes.get(_qualname(type(s.experts)))
        if entry is None:
            continue  # unmatched when analysed: left untouched
        install_expert_parallel(s.experts, num_experts=s.num_experts, ep=ep, options=options, shard=shard,
                                placement=expert_placement(plan, s, ep))
        s.experts.forward = types.MethodType(getattr(module, entry["function"]), s.experts)
        block_entry = classes.get(_qualname(type(s.block)))
        if block_entry is not None and block_entry["archetype"]["level"] == "block":
            s.block.hp_original_forward = s.block.forward
            s.block.forward = types.MethodType(getattr(module, block_entry["function"]), s.block)
        patched.append(s.path)
    return patched
