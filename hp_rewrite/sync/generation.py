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

The ranks of a context group (``cp_size``) or a TP group (``tp_size``) hold the same prompts. A TP group's
dense parts combine its ranks' activations at every step, so its ranks must draw the same tokens: they
start from the group's first rank's random state (their logits are gathered, the same on every rank). A
context group generates whole on every rank, whose logits may round differently. Either way each rank
returns the group's first rank's output and takes its random state, so they go on training on one batch
in one order (TRL shuffles the generated batch with torch's generator), as both need.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.errors import ExpertParallelError

__all__ = ["first_ranks_output", "first_ranks_random_state", "install_lockstep_generation"]


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


def first_ranks_output(out, group):
    """``out`` (a tensor, or any picklable object: an inference engine's completions) as the first rank of
    ``group`` produced it (its length may differ from this rank's)."""
    if isinstance(out, torch.Tensor):
        shape = torch.tensor(out.shape, dtype=torch.int64, device=out.device)
        dist.broadcast(shape, group=group, group_src=0)  # one small read per generate call, not per step
        first = out if dist.get_rank(group) == 0 else out.new_empty(torch.Size(shape.tolist()))
        dist.broadcast(first, group=group, group_src=0)
        return first
    held = [out]  # a GenerateOutput (scores, logits...): its tuples' lengths differ too
    dist.broadcast_object_list(held, group=group, group_src=0)
    return held[0]


def first_ranks_random_state(group, device: torch.device) -> None:
    """Set this rank's torch random streams (the host's and ``device``'s) to the first rank of ``group``'s,
    so what an engine draws after generating (TRL shuffles the generated batch) is drawn alike."""
    streams = [(torch.get_rng_state, torch.set_rng_state)]
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if backend is not None and hasattr(backend, "get_rng_state"):
        streams.append((backend.get_rng_state, backend.set_rng_state))
    for get, put in streams:
        state = get().to(device)  # the collective's device (NCCL / HCCL take device tensors)
        dist.broadcast(state, group=group, group_src=0)
        put(state.cpu())


class _GenerateInGroup:
    """``_generate`` from the group's first rank's random state, then its output and random state (bound to
    the model as its ``generate``)."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, model: nn.Module, *args, **kwargs):
        device = next(model.parameters()).device
        first_ranks_random_state(self.group, device)
        out = first_ranks_output(_generate(model, *args, **kwargs), self.group)
        first_ranks_random_state(self.group, device)
        return out


def _generate_batch(self: nn.Module, *args, **kwargs):
    raise ExpertParallelError(
        "generate_batch (transformers' continuous batching; TRL's use_transformers_continuous_batching) on an "
        "expert-parallel model: it ignores synced_gpus, so ranks whose requests end first would leave the others "
        "waiting in the expert exchange (a hang); use generate (TRL: use_transformers_continuous_batching=False) "
        "or a vLLM / SGLang engine")


def install_lockstep_generation(model: nn.Module, spans_ranks: bool, batch_group=None) -> None:
    """Make ``model.generate`` lockstep by default (and refuse continuous batching) when its expert or
    tensor group ``spans_ranks``, sampling and returning as the first rank of ``batch_group`` (the ranks
    holding one batch: a context or TP group) does; bound methods, so a ``copy.deepcopy`` of the model
    binds its own."""
    if not spans_ranks or not hasattr(model, "generate"):
        return
    generate = _generate if batch_group is None else _GenerateInGroup(batch_group)
    model.generate = types.MethodType(generate, model)
    if hasattr(model, "generate_batch"):
        model.generate_batch = types.MethodType(_generate_batch, model)
