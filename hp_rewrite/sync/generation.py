"""Generation in lockstep over the ranks an expert-parallel forward exchanges tokens with.

Every decoding step's forward runs the MoE exchange over the expert (and tensor) group. When one
rank's sequences end first (EOS on all of them, as sampling or a shorter prompt makes it) and it
leaves ``generate``'s loop, the others wait for it in their next exchange, forever. transformers keeps
ranks in step with ``synced_gpus=True`` (a rank that has finished keeps running the forward, on one new
token per sequence with the cache, discarding its output, until every rank has finished; one
all-reduce of a flag per step says when), but turns it on by itself only for DeepSpeed ZeRO-3 and FSDP
modules, and TRL's trainers never pass it. :func:`install_lockstep_generation` makes it the default of
a rewritten model whose group spans several ranks, as transformers does for FSDP modules: greedy and
sampling, with and without a cache, directly or through PEFT's and TRL's ``generate``. What would
leave the loop early anyway is refused by name: ``synced_gpus=False`` and transformers' continuous
batching (``generate_batch``, which ignores ``synced_gpus``; TRL's ``use_transformers_continuous_batching``).
"""

from __future__ import annotations

import types

from torch import nn

from ..runtime.errors import ExpertParallelError

__all__ = ["install_lockstep_generation"]


def _generate(self: nn.Module, *args, **kwargs):
    """transformers' ``generate``, in lockstep over the world (``synced_gpus=True`` unless passed)."""
    if kwargs.get("synced_gpus") is False:
        raise ExpertParallelError(
            "generate(synced_gpus=False) on an expert-parallel model: a rank whose sequences end first would "
            "leave the loop while the others wait for it in the next step's expert exchange (a hang); leave "
            "synced_gpus unset (hp-rewrite sets it, as transformers does for FSDP modules)")
    if kwargs.get("synced_gpus") is None:
        kwargs["synced_gpus"] = True
    return type(self).generate(self, *args, **kwargs)


def _generate_batch(self: nn.Module, *args, **kwargs):
    raise ExpertParallelError(
        "generate_batch (transformers' continuous batching; TRL's use_transformers_continuous_batching) on an "
        "expert-parallel model: it ignores synced_gpus, so ranks whose requests end first would leave the others "
        "waiting in the expert exchange (a hang); use generate (TRL: use_transformers_continuous_batching=False) "
        "or a vLLM / SGLang engine")


def install_lockstep_generation(model: nn.Module, spans_ranks: bool) -> None:
    """Make ``model.generate`` lockstep by default (and refuse continuous batching) when its expert or
    tensor group ``spans_ranks``; bound methods, so a ``copy.deepcopy`` of the model binds its own."""
    if not spans_ranks or not hasattr(model, "generate"):
        return
    model.generate = types.MethodType(_generate, model)
    if hasattr(model, "generate_batch"):
        model.generate_batch = types.MethodType(_generate_batch, model)
