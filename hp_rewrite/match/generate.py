"""Generation: the forwards of an analysis written as an artifact (generated module, manifest, diff)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..codegen import Artifact, GeneratedFunction, write_artifact
from ..codegen.artifacts import find_current
from .analysis import Analysis, analyze
from .archetype import block_source, experts_source
from .diagnosis import nothing_to_rewrite


def generated_functions(analysis: Analysis) -> list[GeneratedFunction]:
    """One function per patched class, in a deterministic order."""
    funcs: dict[type, GeneratedFunction] = {}
    for r in analysis.matched:
        experts_cls = type(r.structure.experts)
        if experts_cls not in funcs and not r.structure.self_held:  # a block holding its experts: one forward
            arch = {"level": "experts", "router": "model", "shared": "model", "layout": r.archetype.layout}
            params = r.archetype.params if r.archetype.level == "experts" else None  # its EVAL_SCALE
            funcs[experts_cls] = GeneratedFunction(experts_cls, f"{experts_cls.__name__}_forward",
                                                   experts_source(experts_cls.__name__, params), arch)
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
    A plan that rewrites no block of ``model`` is refused (:func:`~.diagnosis.nothing_to_rewrite`)
    before anything is written.
    """
    current = find_current(Path(out_dir), plan.hash(), config)
    if current is not None:
        return current
    analysis = analyze(model, plan)
    if not analysis.matched:
        raise nothing_to_rewrite(model, plan, config, analysis, getattr(config, "_name_or_path", None) or None)
    return write(analysis, plan, config, out_dir)
