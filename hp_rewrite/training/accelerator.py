"""accelerate's ``Accelerator`` around an expert-parallel model, DDP or FSDP2.

Its DDP needs nothing for training (the engine guard, :mod:`hp_rewrite.sync.engines`). Its FSDP2
plugin would shard every rank's own experts over the whole world as if they were one tensor, and
its state dicts would hold rank 0's experts only. :func:`prepare_accelerator` changes, on that one
``Accelerator`` object:

* ``prepare``: under FSDP2 the experts holders are sharded first, as :func:`hp_rewrite.fully_shard`
  shards them (over the expert-replica mesh, divided by the world size, with the plugin's mixed
  precision, reshard and offload policies). accelerate's own preparation then leaves those units
  alone and shards the rest by the user's wrap policy over its data-parallel mesh. Its
  ``cpu_ram_efficient_loading`` (a broadcast of rank 0's weights over the others) is skipped for
  this model: every rank already loaded its own experts and the same other weights.
* ``clip_grad_norm_``: under FSDP2, :func:`hp_rewrite.clip_grad_norm_` (every expert counted once;
  accelerate's own norm misses the other EP ranks' experts);
* ``save_state`` / ``load_state``: the model and its optimizer as one ``torch.distributed.checkpoint``
  with global expert tensors (:mod:`hp_rewrite.training.checkpoint`), whatever ``state_dict_type``
  says (rank 0 alone cannot hold every rank's experts' optimizer state); a PEFT model as its adapter
  (PEFT's files, full shapes) and each rank's optimizer state; the rest (schedulers, samplers, RNG,
  custom objects) by accelerate;
* ``get_state_dict`` / ``save_model``: the full model, experts gathered over the EP group. For a PEFT
  model ``get_state_dict`` holds its adapter tensors whole, under PEFT's names, on every rank (what
  accelerate's PEFT recipe passes to ``save_pretrained(state_dict=...)``; every rank calls it), and
  ``save_model`` is refused (a full checkpoint would hold PEFT's names): save the adapter.

With the plan's ``cp_size`` or ``tp_size`` the data loaders it prepares give each context or TP group one
batch (:mod:`.batches`); a model split over TP groups is prepared without DDP
(:func:`train_split_without_ddp`). DeepSpeed, FSDP1 and accelerate's own tensor or context parallelism in the
``parallelism_config`` are refused, naming the plan field to use instead.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from ..loading.adapters import adapter_tensors
from ..loading.record import info_of, record_of, rewritten_model
from ..loading.save import full_state_dict, save_pretrained
from ..runtime.errors import ExpertParallelError
from ..sync.gradients import trains_rank_local_only
from .batches import share_batches
from .checkpoint import load_checkpoint, save_checkpoint
from .fsdp import clip_grad_norm_, shard_experts
from .rank_state import load_active_adapter, load_optimizer, rank_and_world, save_optimizer
from .rewritten import bucket_bytes, peft_model_of, refuse_unsaved_trainables
from .routing import prepare_accelerator_routing

#: the folder inside an accelerate state (``save_state``) holding model ``i`` and its optimizer
STATE_FOLDER = "hp_rewrite_model_{i}"
#: a PEFT model: its adapter as PEFT saves it, and each rank's optimizer
ADAPTER_FOLDER = "hp_rewrite_adapter_{i}"
ADAPTER_OPTIMIZER_FILE = "optimizer-rank{rank}-of-{world}.pt"


def _kind(accelerator) -> str:
    return str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()


def deepspeed_refusal(what: str) -> ExpertParallelError:
    return ExpertParallelError(
        f"{what}: DeepSpeed (ZeRO) partitions and averages every parameter over the world, each rank's own "
        "experts included; train the expert-parallel model with FSDP2 (fsdp_version: 2: Trainer's fsdp_config, "
        "accelerate's FSDP plugin) or DDP"
    )


def refuse_unsupported(accelerator, what: str) -> None:
    """DeepSpeed, FSDP1, tensor / context parallelism: none keeps each rank's experts its own."""
    kind = _kind(accelerator)
    if kind == "DEEPSPEED":
        raise deepspeed_refusal(what)
    if kind == "FSDP" and getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2:
        raise ExpertParallelError(
            f"{what}: FSDP1 flattens each rank's own experts into one parameter sharded over the world; set "
            "fsdp_version: 2 (accelerate config / FullyShardedDataParallelPlugin(fsdp_version=2) / Trainer "
            "fsdp_config) to train the expert-parallel model with FSDP2"
        )
    config = getattr(accelerator, "parallelism_config", None)
    plan_fields = {  # accelerate's field -> the plan's, and what the plan's does instead
        "cp_size": ("cp_size", "context", "Ulysses context parallelism with the EP group over the context ranks"),
        "sp_size": ("cp_size", "context", "Ulysses context parallelism with the EP group over the context ranks"),
        "tp_size": ("tp_size", "tensor", "tensor parallelism with the EP group extended over the TP ranks"),
    }
    for field, (plan_field, kind, ours) in plan_fields.items():
        size = getattr(config, field, 1) or 1
        if size > 1:
            raise ExpertParallelError(
                f"{what}: ParallelismConfig({field}={size}) splits the model with accelerate's own {kind} "
                f"parallelism, which the expert-parallel rewrite does not follow; set {plan_field}: {size} in the "
                f"hp-rewrite plan instead ({ours}) and leave ParallelismConfig's {field} at 1"
            )


def _is_ep_model(obj) -> bool:
    return isinstance(obj, nn.Module) and rewritten_model(obj) is not None


def _params_of(optimizer) -> list[nn.Parameter]:
    inner = getattr(optimizer, "optimizer", optimizer)
    return [p for group in inner.param_groups for p in group["params"]]


def _upcast_trainable(model: nn.Module) -> None:
    """What accelerate does to every trainable parameter under mixed precision (fp32 masters),
    done to the experts before they are sharded: accelerate's ``param.data =`` would not reach
    FSDP2's shards."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)


def _shard_experts_first(accelerator, model: nn.Module, optimizers: list) -> None:
    """Shard ``model``'s experts holders (module doc), and point the optimizers at their new parameters."""
    inner = rewritten_model(model)
    if info_of(model, "prepare").fsdp is not None:
        return  # already sharded by hp_rewrite.fully_shard: accelerate keeps it as it is
    if any(p.is_meta for p in inner.parameters()):
        raise ExpertParallelError(
            "accelerate prepare: the expert-parallel model has weights on the meta device, and FSDP2's rank-0 "
            "broadcast would copy rank 0's experts over every rank's; load the model on every rank "
            "(hp_rewrite.from_pretrained / auto_patch read each rank's own experts)"
        )
    if accelerator.mixed_precision != "no":
        _upcast_trainable(inner)
    before = dict(inner.named_parameters())
    plugin = accelerator.state.fsdp_plugin
    shard_experts(model, mp_policy=plugin.mixed_precision_policy, reshard_after_forward=plugin.reshard_after_forward,
                  offload_policy=plugin.cpu_offload, what="accelerate prepare")
    after = dict(inner.named_parameters())
    moved = {id(before[n]): after[n] for n in before if n in after and after[n] is not before[n]}
    for optimizer in optimizers:
        for group in getattr(optimizer, "optimizer", optimizer).param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]


def _kept_owners(models: list[nn.Module]) -> list[nn.Module]:
    """The modules holding experts kept quantised, which FSDP2 leaves out (:mod:`.fsdp`)."""
    owners = []
    for model in models:
        kept = record_of(model).fsdp.kept
        owners += [m for m in model.modules() if any(id(p) in kept for p in m.parameters(recurse=False))]
    return owners


@contextlib.contextmanager
def _plugin_for_ep(accelerator, presharded: bool, models: list[nn.Module]):
    """The FSDP2 plugin during ``prepare`` of an expert-parallel model: no rank-0 broadcast (module doc);
    experts kept quantised left out of accelerate's units too; for a model already sharded by
    hp_rewrite.fully_shard no wrap policy either (accelerate keeps an FSDP2 module as it is, but first
    looks its layer classes up by their names, which FSDP2 has changed)."""
    plugin = accelerator.state.fsdp_plugin
    saved = {"cpu_ram_efficient_loading": plugin.cpu_ram_efficient_loading, "auto_wrap_policy": plugin.auto_wrap_policy,
             "ignored_modules": plugin.ignored_modules}
    plugin.cpu_ram_efficient_loading = False
    if presharded:
        plugin.auto_wrap_policy = None
    owners = _kept_owners(models)
    if owners:
        if isinstance(plugin.cpu_offload, CPUOffloadPolicy):  # accelerate moves ignored modules to the device
            raise ExpertParallelError(
                "accelerate prepare: the model keeps experts quantised, which FSDP2 leaves out, and CPU offload would "
                "move their holders' sharded weights behind FSDP2's back; train without cpu_offload, or load the "
                "experts with dequantize=True"
            )
        users = plugin.ignored_modules
        if isinstance(users, str):  # accelerate's own reading of a pattern: module names it fully matches
            users = [m for model in models for name, m in model.named_modules() if re.fullmatch(users, name)]
        plugin.ignored_modules = [*(users or []), *owners]
    try:
        yield
    finally:
        for field, value in saved.items():
            setattr(plugin, field, value)


def _optimizer_of(accelerator, model: nn.Module):
    """The prepared optimizer training ``model`` (the first whose parameters are the model's), or None."""
    params = {id(p) for p in model.parameters()}
    return next((o for o in accelerator._optimizers if any(id(p) in params for p in _params_of(o))), None)


@contextlib.contextmanager
def _hidden(accelerator, models: list[nn.Module], optimizers: list):
    """accelerate's own save_state / load_state, without the models (and optimizers) hp-rewrite saves."""
    kept_models, kept_optimizers = accelerator._models, accelerator._optimizers
    accelerator._models = [m for m in kept_models if all(m is not x for x in models)]
    accelerator._optimizers = [o for o in kept_optimizers if all(o is not x for x in optimizers)]
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = kept_models, kept_optimizers


def _ep_models(accelerator) -> list[tuple[int, nn.Module]]:
    return [(i, m) for i, m in enumerate(accelerator._models) if _is_ep_model(m)]


def _latest_state(accelerator) -> str:
    """The folder ``load_state()`` without a folder reads: the newest automatic checkpoint."""
    root = Path(accelerator.project_dir or ".") / "checkpoints"
    folders = sorted((f for f in root.iterdir() if f.is_dir() and re.search(r"(\d+)$", f.name)),
                     key=lambda f: int(re.search(r"(\d+)$", f.name).group(1))) if root.is_dir() else []
    if not folders:
        raise ExpertParallelError(f"load_state: no checkpoint under {root}; pass input_dir")
    return str(folders[-1])


def _peft_model(accelerator, model: nn.Module):
    """The PEFT model inside a prepared ``model`` (its adapter is what trains and what is saved), or None."""
    return peft_model_of(accelerator.unwrap_model(model), "prepare_accelerator")


def _optimizer_file(folder: Path) -> Path:
    rank, world = rank_and_world()
    return folder / ADAPTER_OPTIMIZER_FILE.format(rank=rank, world=world)


def save_adapter_state(peft, optimizer, folder: Path, main: bool) -> None:
    """A PEFT model: the adapter as PEFT saves it (full shapes, every rank joins the gathering save) and
    each rank's whole optimizer state (adapters only: small; FSDP2's shards as this rank holds them)."""
    refuse_unsaved_trainables(peft, "save_state")
    folder.mkdir(parents=True, exist_ok=True)
    peft.save_pretrained(folder, is_main_process=main)
    if optimizer is not None:
        save_optimizer(optimizer, peft, _optimizer_file(folder))


def load_adapter_state(peft, optimizer, folder: Path) -> None:
    """Put back what :func:`save_adapter_state` wrote: the active adapter through PEFT's ``load_adapter``
    (each rank keeps its experts' slices, its FSDP2 shards), this rank's optimizer state (same world and
    experts)."""
    load_active_adapter(peft, folder, "load_state")
    if optimizer is not None:
        load_optimizer(optimizer, peft, _optimizer_file(folder), "load_state")


def refuse_split_under_fsdp(accelerator, model, what: str) -> None:
    """The engine's FSDP2 around a model split over TP groups: not supported yet (checked before anything
    is changed on the engine)."""
    if record_of(model).ep.tp_size > 1 and (getattr(accelerator, "is_fsdp2", False) or _kind(accelerator) == "FSDP"):
        raise ExpertParallelError(
            f"{what}: FSDP2 through the engine around a model split over TP groups (tp_size "
            f"{record_of(model).ep.tp_size}) is not supported yet; use the engine's DDP (no fsdp config: the "
            "TP slices are reduced over the data-parallel ranks), or shard it in a loop with hp_rewrite.fully_shard")


def train_split_without_ddp(accelerator, model, what: str) -> None:
    """A model split over TP groups (``tp_size > 1``): its dense weights are DTensor slices, which DDP
    cannot average (and a world mean would mix slices). accelerate prepares it without DDP and the engine
    guard reduces every gradient at each synchronising step as ``hp_rewrite.sync_gradients`` does (slices
    over the data-parallel ranks holding them); ``clip_grad_norm_`` counts each slice once. FSDP2 is
    refused (:func:`refuse_split_under_fsdp`): train it in a loop with ``hp_rewrite.fully_shard``."""
    refuse_split_under_fsdp(accelerator, model, what)
    leave_out_ddp(accelerator, model, everything=True)

    def clip_each_slice_once(parameters, max_norm, norm_type=2):
        accelerator.unscale_gradients()
        return clip_grad_norm_(parameters, max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_each_slice_once


def leave_out_ddp(accelerator, model, everything: bool = False) -> None:
    """accelerate prepares ``model`` without DDP (its ``evaluation_mode``: device placement, mixed precision
    and compile, no DDP), and the engine guard reduces its gradients at every synchronising step
    (accelerate's ``sync_gradients``), as under DDP: the rank-local ones when every trainable parameter is
    rank-local (adapters on the experts only: DDP would have nothing to manage and refuses to be built),
    all of them with ``everything`` (:func:`train_split_without_ddp`)."""
    guard = record_of(model).engine
    if guard is None:
        raise ExpertParallelError(f"{type(model).__name__} has no hp-rewrite engine guard (no rewritten MoE block) "
                                  "to reduce its gradients without DDP; load it with hp_rewrite.from_pretrained")
    prepare_model = accelerator.prepare_model

    def prepare_model_without_ddp(m, device_placement=None, evaluation_mode=False):
        mine = rewritten_model(m) is model
        return prepare_model(m, device_placement=device_placement, evaluation_mode=evaluation_mode or mine)

    accelerator.prepare_model = prepare_model_without_ddp
    guard.sync_without_ddp(lambda: accelerator.sync_gradients, everything, bucket_bytes(record_of(model)))


def prepare_accelerator(accelerator):
    """Make ``accelerator`` prepare, clip, save and load an expert-parallel model exactly (module doc).

    Call it on every rank right after creating the Accelerator, before ``prepare``. Returns it.
    """
    if getattr(accelerator, "hp_rewrite_prepared", False):
        return accelerator
    refuse_unsupported(accelerator, "prepare_accelerator")
    prepare, clip, save_state, load_state = (accelerator.prepare, accelerator.clip_grad_norm_,
                                             accelerator.save_state, accelerator.load_state)

    def prepare_ep(*args, device_placement=None):
        for model in (a for a in args if _is_ep_model(a)):
            refuse_split_under_fsdp(accelerator, rewritten_model(model), "prepare_accelerator")
        for model in (a for a in args if _is_ep_model(a)):  # one batch per context or TP group
            share_batches(accelerator, record_of(model).ep.batch_ranks, "prepare_accelerator")
            if record_of(model).ep.tp_size > 1:
                train_split_without_ddp(accelerator, rewritten_model(model), "prepare_accelerator")
        if accelerator.is_fsdp2 and any(_is_ep_model(a) for a in args):
            optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
            models = [a for a in args if _is_ep_model(a)]
            presharded = any(record_of(m).fsdp is not None for m in models)
            for model in models:
                _shard_experts_first(accelerator, model, optimizers)
            with _plugin_for_ep(accelerator, presharded, models):
                prepared = prepare(*args, device_placement=device_placement)
        else:
            for model in (a for a in args if _is_ep_model(a)):
                if (accelerator.num_processes > 1 and record_of(model).ep.tp_size == 1
                        and trains_rank_local_only(rewritten_model(model), model)):
                    leave_out_ddp(accelerator, rewritten_model(model))
            prepared = prepare(*args, device_placement=device_placement)
        prepare_accelerator_routing(accelerator, prepared)
        return prepared

    def clip_ep(parameters, max_norm, norm_type=2):
        if accelerator.is_fsdp2 and _ep_models(accelerator):
            accelerator.unscale_gradients()
            return clip_grad_norm_(parameters, max_norm, norm_type)
        return clip(parameters, max_norm, norm_type)

    def save_state_ep(output_dir=None, safe_serialization=True, **kwargs):
        models = _ep_models(accelerator)
        optimizers = [_optimizer_of(accelerator, m) for _, m in models]
        with _hidden(accelerator, [m for _, m in models], [o for o in optimizers if o is not None]):
            location = save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        for (i, model), optimizer in zip(models, optimizers, strict=True):
            inner = None if optimizer is None else getattr(optimizer, "optimizer", optimizer)
            peft = _peft_model(accelerator, model)
            if peft is not None:
                save_adapter_state(peft, inner, Path(location) / ADAPTER_FOLDER.format(i=i), accelerator.is_main_process)
            else:
                save_checkpoint(model, inner, Path(location) / STATE_FOLDER.format(i=i))
        return location

    def load_state_ep(input_dir=None, **kwargs):
        models = _ep_models(accelerator)
        if input_dir is None and models:
            input_dir = _latest_state(accelerator)
        optimizers = [_optimizer_of(accelerator, m) for _, m in models]
        with _hidden(accelerator, [m for _, m in models], [o for o in optimizers if o is not None]):
            load_state(input_dir, **kwargs)
        for (i, model), optimizer in zip(models, optimizers, strict=True):
            peft = _peft_model(accelerator, model)
            folder = Path(input_dir) / (STATE_FOLDER if peft is None else ADAPTER_FOLDER).format(i=i)
            if not folder.is_dir():
                raise ExpertParallelError(
                    f"load_state: {input_dir} has no {folder.name} (the expert-parallel model's state); load a "
                    "state written by an Accelerator passed to hp_rewrite.prepare_accelerator"
                )
            inner = None if optimizer is None else getattr(optimizer, "optimizer", optimizer)
            if peft is not None:
                load_adapter_state(peft, inner, folder)
            else:
                load_checkpoint(model, inner, folder)

    def get_state_dict_ep(model, unwrap=True):
        peft = _peft_model(accelerator, model) if _is_ep_model(model) else None
        if peft is not None:  # what PEFT's save_pretrained(state_dict=...) reads: the adapters, whole
            keys = {key for key, _ in adapter_tensors(peft)}
            return {k: v for k, v in peft.state_dict().items() if k in keys}  # collective (module doc)
        if _is_ep_model(model):
            return full_state_dict(rewritten_model(model))
        return type(accelerator).get_state_dict(accelerator, model, unwrap)

    def save_model_ep(model, save_directory, max_shard_size="10GB", safe_serialization=True):
        if _is_ep_model(model):
            os.makedirs(save_directory, exist_ok=True)
            save_pretrained(rewritten_model(model), save_directory, max_shard_size=max_shard_size)
            return
        type(accelerator).save_model(accelerator, model, save_directory, max_shard_size, safe_serialization)

    accelerator.prepare = prepare_ep
    accelerator.clip_grad_norm_ = clip_ep
    accelerator.save_state = save_state_ep
    accelerator.load_state = load_state_ep
    accelerator.get_state_dict = get_state_dict_ep
    accelerator.save_model = save_model_ep
    accelerator.hp_rewrite_prepared = True
    return accelerator
