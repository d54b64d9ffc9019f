"""Load-time integration: every ``from_pretrained`` of a transformers MoE model returns it rewritten.

``auto_patch(plan)`` wraps ``PreTrainedModel.from_pretrained`` (which every concrete class and every
Auto class ends in) until ``remove()`` or the end of a ``with`` block; ``from_pretrained(model_dir,
plan=...)`` does the same for one call. The EP group is built from the plan over the initialised
``torch.distributed`` world; without one, the model runs as EP=1 in one process through the same
generated code.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn

from ..plan import Plan, load_plan
from ..runtime import ExpertParallelError, ExpertParallelGroup, build_expert_parallel_group

PLAN_ENV = "HP_REWRITE_PLAN"
DEFAULT_ARTIFACT_DIR = Path.home() / ".cache" / "hp-rewrite"


@dataclass
class RewriteInfo:
    """Attached to a rewritten model as ``model.hp_rewrite``."""

    plan: Plan
    ep: ExpertParallelGroup
    artifact_dir: Path
    patched: list[str]


def resolve_plan(plan: str | os.PathLike | Plan | None) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if plan is None:
        plan = os.environ.get(PLAN_ENV)
        if not plan:
            raise ExpertParallelError(f"no plan given: pass auto_patch(plan) or set {PLAN_ENV} to a plan file")
    return load_plan(plan)


def expert_parallel_group_for(plan: Plan) -> ExpertParallelGroup:
    """The plan's EP group over the initialised world, or EP=1 in a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return ExpertParallelGroup.single()
    return build_expert_parallel_group(plan.ep_size, timeout_s=plan.runtime.timeout_s)


def rewrite_model(model: nn.Module, plan: Plan, ep: ExpertParallelGroup | None = None,
                  artifact_dir: Path | None = None) -> nn.Module:
    """Make a loaded model expert-parallel in place (generate on rank 0, install everywhere)."""
    from ..rewrite import analyze, install, write

    if getattr(model, "hp_rewrite", None) is not None:
        return model
    ep = ep or expert_parallel_group_for(plan)
    out = Path(artifact_dir or plan.output.dir or DEFAULT_ARTIFACT_DIR)
    distributed = dist.is_available() and dist.is_initialized()
    analysis = analyze(model, plan)
    if distributed and dist.get_rank() != 0:
        dist.barrier()  # rank 0 writes the artifact; the others then find it current and reuse it
        artifact = write(analysis, plan, model.config, out)
    else:
        artifact = write(analysis, plan, model.config, out)
        if distributed:
            dist.barrier()
    patched = install(model, artifact, plan, ep, shard=True)
    model.hp_rewrite = RewriteInfo(plan, ep, artifact.directory, patched)
    # the model's own save_pretrained would write only this rank's experts: gather them instead
    model.hp_original_save_pretrained = model.save_pretrained
    model.save_pretrained = types.MethodType(_save_pretrained, model)
    return model


def _save_pretrained(self: nn.Module, save_directory, *args, **kwargs):
    """Gather the experts and write a standard checkpoint (see :mod:`hp_rewrite.loading.save`)."""
    from .save import save_pretrained

    if args or kwargs:
        raise ExpertParallelError(
            f"save_pretrained of an expert-parallel model takes only the directory (got {sorted(kwargs)}); "
            "it writes safetensors shards with the model's in-memory names"
        )
    return save_pretrained(self, save_directory)


class AutoPatch:
    """Handle of an installed auto-patch; also a context manager that removes it on exit."""

    def __init__(self, plan: Plan, artifact_dir: Path | None = None) -> None:
        from transformers import PreTrainedModel

        self.plan, self.artifact_dir = plan, artifact_dir
        self._owner = PreTrainedModel
        self._original = PreTrainedModel.__dict__["from_pretrained"]
        original_fn = self._original.__func__
        patch = self

        def from_pretrained(cls, *args, **kwargs):
            model = original_fn(cls, *args, **kwargs)
            return rewrite_model(model, patch.plan, artifact_dir=patch.artifact_dir)

        from_pretrained.__doc__ = original_fn.__doc__
        from_pretrained.hp_auto_patch = self
        self._patched = classmethod(from_pretrained)
        self.active = False

    def install(self) -> AutoPatch:
        current = self._owner.__dict__["from_pretrained"]
        if getattr(current.__func__, "hp_auto_patch", None) is not None:
            raise RuntimeError("hp-rewrite auto-patch is already installed; remove() it first")
        self._owner.from_pretrained = self._patched
        self.active = True
        return self

    def remove(self) -> None:
        if self.active:
            self._owner.from_pretrained = self._original
            self.active = False

    def __enter__(self) -> AutoPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def auto_patch(plan: str | os.PathLike | Plan | None = None, artifact_dir: Path | None = None) -> AutoPatch:
    """Install the patch now (global) and return its handle; ``with auto_patch(p):`` scopes it.

    With no plan, the path is read from the ``HP_REWRITE_PLAN`` environment variable (at this call,
    never at import time).
    """
    return AutoPatch(resolve_plan(plan), artifact_dir).install()


def from_pretrained(model_dir: str | os.PathLike, plan: str | os.PathLike | Plan | None = None,
                    artifact_dir: Path | None = None, **kwargs) -> nn.Module:
    """Load a checkpoint and return it rewritten (one call, no global patch left behind)."""
    from transformers import AutoConfig

    from .tiny import auto_class_for

    config = AutoConfig.from_pretrained(model_dir)
    kwargs.setdefault("attn_implementation", "eager")
    model = auto_class_for(config).from_pretrained(model_dir, **kwargs)
    return rewrite_model(model, resolve_plan(plan), artifact_dir=artifact_dir)
