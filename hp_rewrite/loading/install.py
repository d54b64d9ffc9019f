"""Install an artifact's generated forwards on a model with real weights (no analysis re-run)."""

from __future__ import annotations

import types

from torch import nn

from ..codegen import Artifact, import_artifact
from ..hf import top_k_of
from ..match import find_blocks
from ..match.analysis import expert_placement
from ..match.diagnosis import nothing_to_rewrite
from ..match.structure import router_path, selection_bias
from ..runtime import installed
from ..runtime.binding.install import install_expert_parallel
from ..runtime.group.groups import ExpertParallelGroup
from ..runtime.options import RuntimeOptions
from ..runtime.overlap.context import ExchangeRuntime
from ..runtime.routing.routing_load import RouterOf


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def install(model: nn.Module, artifact: Artifact, plan, ep: ExpertParallelGroup,
            options: RuntimeOptions | None = None, shard: bool = True) -> list[str]:
    """Install the artifact's forwards on ``model`` (real weights). Returns the patched block paths.

    The model's MoE layers share one :class:`~hp_rewrite.runtime.overlap.context.ExchangeRuntime` (the deferred
    expert-gradient queue and the micro-batch turn hook): ``exchange_runtimes(model)`` finds it."""
    module = import_artifact(artifact)
    runtime = ExchangeRuntime()
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
                                placement=expert_placement(plan, s, ep), runtime=runtime, bind_forward=not s.self_held)
        if not s.self_held:  # a block holding its experts has only the block forward
            s.experts.forward = types.MethodType(getattr(module, entry["function"]), s.experts)
        block_entry = classes.get(_qualname(type(s.block)))
        block_level = block_entry is not None and block_entry["archetype"]["level"] == "block"
        router = router_path(s)
        installed.state_of(s.experts).router = RouterOf(
            s.block, router, *(selection_bias(s) or (None, None)),
            chooses=block_level and block_entry["archetype"]["router"] == "topk_router_module",
            top_k=top_k_of(s.block, s.block.get_submodule(router) if router else None, getattr(model, "config", None)))
        if block_entry is not None and block_entry["archetype"]["level"] == "block":
            installed.keep_original_forward(s.block)
            s.block.forward = types.MethodType(getattr(module, block_entry["function"]), s.block)
        patched.append(s.path)
    if not patched:  # an artifact written for another model, or nothing selected: never a silent no-op
        raise nothing_to_rewrite(model, plan, getattr(model, "config", None))
    return patched
