"""Training a rewritten model: gradient synchronisation for hand-written loops, and the engines.

A model rewritten by ``auto_patch`` / ``from_pretrained`` is exact inside ``DistributedDataParallel``
as built by the user, transformers ``Trainer`` or accelerate (see :mod:`hp_rewrite.sync.engines`).
Without DDP, :func:`sync_gradients` (after backward) or :func:`gradient_sync` (during it) apply the
same contract. :func:`prepare_trainer` makes a ``Trainer`` save and resume the rank-local experts.
See docs/training.md.
"""

from __future__ import annotations

from torch import nn

from ..runtime.errors import ExpertParallelError
from ..sync import gradients
from ..sync.gradients import has_tuner_layers


def sync_gradients(model: nn.Module) -> None:
    """Apply the EP x DP gradient contract (see :mod:`hp_rewrite.sync.gradients`) to a model
    rewritten by ``auto_patch`` / ``from_pretrained`` (it knows its EP group). Not on top of DDP."""
    info = info_of(model, "sync_gradients")
    _refuse_on_fsdp(info, "sync_gradients")
    if info.engine is not None:
        info.engine.refuse_manual_sync("sync_gradients")
    gradients.sync_gradients(rewritten_model(model), info.ep, _bucket_bytes(info))
    if info.engine is not None:
        info.engine.mark_reduced()  # a later backward adds to final values (see EngineGuard._unreduce)


def rewritten_model(model: nn.Module) -> nn.Module | None:
    """The rewritten model itself, inside whatever wraps it (PEFT, DDP, torch.compile)."""
    for m in model.modules():
        if vars(m).get("hp_rewrite") is not None:  # not getattr: PEFT models forward attribute lookups
            return m
    return None


def peft_model_of(model: nn.Module, what: str, refuse_others: bool = True) -> nn.Module | None:
    """The PEFT ``PeftModel`` that is ``model`` (or that a DDP / compile wrapper holds): its adapter is
    what trains and what is saved. None for a model without adapters. Adapters put in another way
    (transformers' ``add_adapter``, PEFT's ``inject_adapter_in_model``) are refused: their state is
    neither PEFT's files nor the model's, so no checkpoint here could resume them. Trainable parameters
    outside the adapter PEFT saves are refused too (:func:`refuse_unsaved_trainables`). With
    ``refuse_others=False`` such a model gives None (nothing here saves it)."""
    if not has_tuner_layers(model):
        return None
    from peft import PeftModel  # installed: something put its tuner layers in the model

    found = next((m for m in model.modules() if isinstance(m, PeftModel)), None)  # FSDP2's subclass too
    if found is None and refuse_others:
        raise ExpertParallelError(
            f"{what}: the model carries adapters that are not inside a PEFT PeftModel (transformers' add_adapter or "
            "PEFT's inject_adapter_in_model); wrap the expert-parallel model with peft.get_peft_model(model, config) "
            "instead, which saves and resumes as PEFT does"
        )
    return found


def refuse_unsaved_trainables(peft: nn.Module, what: str) -> None:
    """An adapter checkpoint holds what PEFT saves (its adapter layers, ``modules_to_save``): a trainable
    parameter outside them would resume at its old value with newer optimizer state, silently."""
    saved = {id(p) for m in peft.modules() if hasattr(m, "adapter_layer_names") or hasattr(m, "modules_to_save")
             for layer in (*getattr(m, "adapter_layer_names", ()), "modules_to_save")
             if isinstance(getattr(m, layer, None), nn.Module) for p in getattr(m, layer).parameters()}
    unsaved = [n for n, p in peft.named_parameters() if p.requires_grad and id(p) not in saved]
    if unsaved:
        raise ExpertParallelError(
            f"{what}: {unsaved[0]}{f' (and {len(unsaved) - 1} more)' if len(unsaved) > 1 else ''} trains but is not "
            "part of the adapter PEFT saves, so "
            "a checkpoint would not hold it; name its module in LoraConfig(modules_to_save=[...]) or freeze it"
        )


def info_of(model: nn.Module, what: str):
    """``model.hp_rewrite`` of the rewritten model inside ``model``, or a clear error."""
    inner = rewritten_model(model)
    if inner is None:
        raise ValueError(f"{what}: this model was not rewritten by hp-rewrite (no model.hp_rewrite)")
    return inner.hp_rewrite


def gradient_sync(model: nn.Module) -> gradients.GradientSync:
    """The same contract as :func:`sync_gradients`, overlapped with backward (see
    :class:`hp_rewrite.sync.gradients.GradientSync`): create once, call ``.wait()`` after every
    ``backward()``."""
    info = info_of(model, "gradient_sync")
    _refuse_on_fsdp(info, "gradient_sync")
    return gradients.GradientSync(rewritten_model(model), info.ep, _bucket_bytes(info), guard=info.engine)


def _bucket_bytes(info) -> int:
    """The plan's ``runtime.grad_bucket_mb`` in bytes."""
    return max(1, int(info.plan.runtime.grad_bucket_mb * 2**20))


def _refuse_on_fsdp(info, what: str) -> None:
    if info.fsdp is not None:
        raise ExpertParallelError(
            f"{what}: this model is sharded by hp_rewrite.fully_shard, whose FSDP2 reduce-scatters already give "
            f"every gradient the unmodified model's value after backward(); remove the {what} call"
        )


def fully_shard(model: nn.Module, **kwargs) -> nn.Module:
    """FSDP2 for a rewritten model: experts over the expert-replica mesh, the rest over data
    parallel (see :mod:`hp_rewrite.training.fsdp`)."""
    from .fsdp import fully_shard as shard

    return shard(model, **kwargs)


def load_fully_sharded(model_dir, plan=None, **kwargs) -> nn.Module:
    """A checkpoint read straight into :func:`fully_shard`'s shards: each rank reads only what it keeps
    (see :mod:`hp_rewrite.training.sharded_load`)."""
    from .sharded_load import load_fully_sharded as load

    return load(model_dir, plan, **kwargs)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0):
    """``clip_grad_norm_`` whose total norm counts every parameter once, sharded or not (see
    :func:`hp_rewrite.training.fsdp.clip_grad_norm_`)."""
    from .fsdp import clip_grad_norm_ as clip

    return clip(parameters, max_norm, norm_type)


def save_checkpoint(model: nn.Module, optimizer, checkpoint_dir) -> None:
    """torch.distributed.checkpoint of model and optimizer, resumable at another EP size (see
    :mod:`hp_rewrite.training.checkpoint`). Collective."""
    from .checkpoint import save

    save(model, optimizer, checkpoint_dir)


def load_checkpoint(model: nn.Module, optimizer, checkpoint_dir) -> None:
    """Load what :func:`save_checkpoint` wrote, at this model's EP size and sharding. Collective."""
    from .checkpoint import load

    load(model, optimizer, checkpoint_dir)


def prepare_trainer(trainer):
    """Make a transformers ``Trainer`` (or a subclass: TRL's ``SFTTrainer``...) save, checkpoint and
    resume an expert-parallel model exactly (see :mod:`hp_rewrite.training.trainer`)."""
    from .trainer import prepare_trainer as prepare

    return prepare(trainer)


def prepare_accelerator(accelerator):
    """Make an accelerate ``Accelerator`` prepare (FSDP2 included), clip, save and load an
    expert-parallel model exactly (see :mod:`hp_rewrite.training.accelerator`)."""
    from .accelerator import prepare_accelerator as prepare

    return prepare(accelerator)


def routing_stats(model: nn.Module):
    """The routing statistics (tokens per expert over the global batch, imbalance, dead experts,
    drops, exchange bytes) since the last read; every rank calls it (see :mod:`.routing`)."""
    from .routing import routing_stats as stats

    return stats(model)


def track_routing(model: nn.Module, optimizer):
    """After every ``optimizer.step()`` of ``optimizer`` (a step post hook): the routing counts reduced,
    the selection biases updated (``routing.bias_update_rate``); see :mod:`.routing`."""
    from .routing import track_routing as track

    return track(model, optimizer)
