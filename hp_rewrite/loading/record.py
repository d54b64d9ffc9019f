"""The record a rewritten model carries (``model.hp_rewrite``), written and found here only.

The record sits in the rewritten model's own attributes. Engines wrap that model (PEFT's ``PeftModel``
and ``LoraModel``, DDP, FSDP2, ``torch.compile``), and some wrappers forward attribute lookups to what
they wrap (PEFT's do), others do not (DDP): so the record is found by a search of ``model.modules()``
for the module that holds it itself (:func:`rewritten_model`), which sees through every one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..plan import Plan
from ..runtime.group.groups import ExpertParallelGroup
from ..runtime.overlap.context import ExchangeRuntime
from ..runtime.routing.routing_load import ModelRouting
from ..sync.engines import EngineGuard

#: the attribute, public: ``model.hp_rewrite.summary`` is what a user reads
_RECORD = "hp_rewrite"


@dataclass
class RewriteInfo:
    """What a rewritten model carries, as ``model.hp_rewrite`` (users read it: ``summary``,
    ``runtime.weight_grads``...)."""

    plan: Plan
    ep: ExpertParallelGroup
    artifact_dir: Path
    patched: list[str]
    load_report: dict | None = None  # set when only local experts were read (loading.local)
    engine: EngineGuard | None = None  # DDP contract and refusals (sync.engines)
    fsdp: object | None = None  # the meshes of hp_rewrite.fully_shard, once applied (training.fsdp)
    runtime: ExchangeRuntime | None = None  # what its MoE layers share: the deferred-gradient queue, turn hook
    tensor: object | None = None  # the TP layout of the dense parts (hp_rewrite.tensor), with tp_size > 1
    context: object | None = None  # the sequence split (hp_rewrite.context.ContextSplit), with cp_size > 1
    routing: ModelRouting | None = None  # the routing counts the plan's routing section asks for
    summary: str = ""  # what this rank holds, one line (logged at load: load_summary)
    original_save_pretrained: Callable | None = None  # the model's own, before the one that gathers experts


def set_record(model: nn.Module, info: RewriteInfo) -> None:
    vars(model)[_RECORD] = info


def rewritten_model(model: nn.Module) -> nn.Module | None:
    """The rewritten model itself, inside whatever wraps it (PEFT, DDP, torch.compile); None if none."""
    return next((m for m in model.modules() if vars(m).get(_RECORD) is not None), None)


def record_of(model: nn.Module) -> RewriteInfo | None:
    """The record of the rewritten model inside ``model`` (or that is ``model``); None if there is none."""
    inner = rewritten_model(model)
    return None if inner is None else vars(inner)[_RECORD]


def record_here(model: nn.Module) -> RewriteInfo | None:
    """The record of ``model`` itself, or of the model a PEFT wrapper forwards attribute lookups to; not
    through DDP or another container (a model wrapped before its rewrite is refused by name instead)."""
    return getattr(model, _RECORD, None)


def info_of(model: nn.Module, what: str) -> RewriteInfo:
    """:func:`record_of`, or a clear error naming ``what`` needed it."""
    info = record_of(model)
    if info is None:
        raise ValueError(f"{what}: this model was not rewritten by hp-rewrite (no model.hp_rewrite)")
    return info
