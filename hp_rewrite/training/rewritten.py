"""The rewritten model inside whatever wraps it (PEFT, DDP, torch.compile), its record, and the EP x DP
gradient contract for hand-written loops: :func:`sync_gradients` after backward, :func:`gradient_sync`
during it (both refused on top of DDP and FSDP2, which synchronise already)."""

from __future__ import annotations

from torch import nn

from ..loading.record import info_of, rewritten_model
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
    gradients.reduce_gradients(rewritten_model(model), info.ep, bucket_bytes(info))
    if info.engine is not None:
        info.engine.mark_reduced()  # a later backward adds to final values (see EngineGuard._unreduce)




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




def gradient_sync(model: nn.Module) -> gradients.GradientSync:
    """The same contract as :func:`sync_gradients`, overlapped with backward (see
    :class:`hp_rewrite.sync.gradients.GradientSync`): create once, call ``.wait()`` after every
    ``backward()``."""
    info = info_of(model, "gradient_sync")
    _refuse_on_fsdp(info, "gradient_sync")
    return gradients.GradientSync(rewritten_model(model), info.ep, bucket_bytes(info), guard=info.engine)


def bucket_bytes(info) -> int:
    """The plan's ``runtime.grad_bucket_mb`` in bytes."""
    return max(1, int(info.plan.runtime.grad_bucket_mb * 2**20))


def _refuse_on_fsdp(info, what: str) -> None:
    if info.fsdp is not None:
        raise ExpertParallelError(
            f"{what}: this model is sharded by hp_rewrite.fully_shard, whose FSDP2 reduce-scatters already give "
            f"every gradient the unmodified model's value after backward(); remove the {what} call"
        )
