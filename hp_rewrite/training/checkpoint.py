"""``torch.distributed.checkpoint`` (DCP) of an expert-parallel model and its optimizer: resumable at
the same EP size, or at another (EP 2 -> EP 4), because the experts are saved as one global tensor.

Each rank holds ``E / ep`` experts (FSDP2 may shard those again over the expert replicas). Saved as
they are, every EP rank would write a different tensor under the same name. So in the state dict
handed to DCP an expert weight (and each of its optimizer moments) is a DTensor of the *global*
shape ``[E, ...]`` over an ``("ep", "efsdp")`` view of the mesh: ``ep`` splits dim 0 into the ranks'
experts and ``efsdp`` the dimension FSDP2 shards (or replicates, without FSDP2). The view aliases
the rank's own storage, so DCP writes from and reads into the live tensors; loading into a model of
another EP size asks DCP for other slices of the same global tensors. Non-expert weights are what
they are: FSDP2 DTensors, or plain replicated tensors (DCP writes one copy).

Expert order must be the checkpoint's order: a balanced placement (``placement: balanced``) is
refused.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..loading.record import info_of, rewritten_model
from ..loading.save import state_dict_name
from ..runtime import installed
from ..runtime.compute.quantized import QuantizedWeight
from ..runtime.errors import ExpertParallelError
from ..sync.gradients import expert_parameters, has_tuner_layers, rank_local_parameters


def _experts_by_name(model: nn.Module) -> dict[str, nn.Module]:
    """Name of every expert weight -> its holder; refuses what a global view cannot express."""
    names = {}
    for path, holder in model.named_modules():
        binding = installed.binding(holder)
        if binding is None or installed.layout(holder).modules:  # expert modules: each tensor one expert, named globally
            continue
        if not binding.placement.is_contiguous:
            raise ExpertParallelError(
                f"checkpoint: {path} uses a balanced expert placement; a distributed checkpoint stores experts in "
                "expert order. Use placement: contiguous to save and resume with DCP"
            )
        if installed.layout(holder).zero_experts and binding.ep.size * binding.ep.replica_size > 1:
            raise ExpertParallelError(
                f"checkpoint: {path} keeps its zero (identity) experts' {', '.join(installed.layout(holder).padded_names)} "
                "rows on every rank, which a distributed checkpoint's global view cannot express; save with "
                "hp_rewrite.save_pretrained(model, dir) (and Trainer: hp_rewrite.prepare_trainer) instead"
            )
        if any(isinstance(p, QuantizedWeight) for p in holder.parameters()):
            raise ExpertParallelError(
                f"checkpoint: {path} keeps its experts quantised (dequantize=False): they are frozen and are the "
                "checkpoint you loaded; save what trains, the adapters, with peft_model.save_pretrained(dir) on every "
                "rank (Trainer: hp_rewrite.prepare_trainer)"
            )
        path = state_dict_name(path)  # DCP's state dicts drop activation checkpointing's wrapper
        for w in installed.layout(holder).weight_names:
            names[f"{path}.{w}" if path else w] = holder
    weights = {id(p) for p in expert_parameters(model)}
    if has_tuner_layers(model) or any(id(p) not in weights for p in rank_local_parameters(model)):
        # (under FSDP2 a PEFT model's state dict holds its adapters whole, which DCP could not load in place)
        raise ExpertParallelError(
            "checkpoint: PEFT adapters are not saved by hp_rewrite's distributed checkpoint; save the adapter as "
            "PEFT does, peft_model.save_pretrained(dir) on every rank, and each rank's optimizer state "
            "(accelerate's save_state and Trainer's checkpoints do both once prepared by hp_rewrite), or merge the "
            "adapters (merge_and_unload()) first"
        )
    return names


def _view_mesh(model: nn.Module) -> DeviceMesh | None:
    """The model's mesh with its ``ep`` dimension moved first (``("ep", "efsdp")``, or ``("ep",
    "dp_replicate", "efsdp")``): experts split first by EP rank, then as FSDP2 cut them within it. No
    process groups are created for it."""
    ep = info_of(model, "checkpoint").ep
    if ep.mesh is None:
        return None
    names = tuple(ep.mesh.mesh_dim_names)
    ranks = ep.mesh.mesh.permute(len(names) - 1, *range(len(names) - 1)).contiguous()
    return DeviceMesh(ep.mesh.device_type, ranks, mesh_dim_names=(names[-1], *names[:-1]), _init_backend=False)


def _dim0(holder: nn.Module) -> int:
    """Dim 0 of a full expert weight: the experts, or their rows for flat ``[E*R, C]`` layouts (DBRX)."""
    return installed.binding(holder).num_experts * (installed.layout(holder).flat or 1)


def _global_view(t: torch.Tensor, num_experts: int, mesh: DeviceMesh | None) -> torch.Tensor:
    """This rank's experts (a plain tensor, or FSDP2's DTensor over the expert-replica dimensions) as
    its part of the global ``[num_experts, ...]`` tensor (``num_experts``: its dim 0); shares the rank's storage."""
    if mesh is None:  # one process: the local tensor is the global one
        return t
    if isinstance(t, DTensor):  # its placements follow the expert-replica dimensions, in mesh order
        local, inner = t.to_local(), tuple(t.placements)
    else:
        local, inner = t, (Replicate(),) * (mesh.ndim - 1)
    shape = (num_experts, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, (Shard(0), *inner), run_check=False, shape=torch.Size(shape),
                              stride=stride)


def _views(model: nn.Module, optimizer=None) -> tuple[dict, dict | None]:
    inner = rewritten_model(model)
    experts = _experts_by_name(inner)
    mesh = _view_mesh(inner)
    model_sd = get_model_state_dict(inner)
    for name, holder in experts.items():
        model_sd[name] = _global_view(model_sd[name], _dim0(holder), mesh)
    if optimizer is None:
        return model_sd, None
    optim_sd = get_optimizer_state_dict(inner, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=False))
    for name, state in list(optim_sd["state"].items()):
        holder = experts.get(name)
        if holder is None:
            continue
        n = _dim0(holder)
        # a new dict: the optimizer's own per-parameter state dict must keep its tensors
        optim_sd["state"][name] = {k: _global_view(v, n, mesh) if torch.is_tensor(v) and v.dim() else v
                                   for k, v in state.items()}
    return model_sd, optim_sd


def save_checkpoint(model: nn.Module, optimizer, checkpoint_dir: str | os.PathLike) -> None:
    """Save model (and optimizer, if given) with torch.distributed.checkpoint, resumable at another EP size
    and sharding. Collective: every rank calls it."""
    model_sd, optim_sd = _views(model, optimizer)
    state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=str(checkpoint_dir))


def load_checkpoint(model: nn.Module, optimizer, checkpoint_dir: str | os.PathLike, model_weights: bool = True) -> None:
    """Load what :func:`save_checkpoint` wrote into ``model`` (and ``optimizer``), at any EP size and world
    whose experts divide as the plan says; the optimizer's state alone with ``model_weights=False``.
    Collective."""
    inner = rewritten_model(model)
    model_sd, optim_sd = _views(model, optimizer)
    state = {"model": model_sd} if model_weights else {}
    if optim_sd is not None:
        state["optim"] = optim_sd
    # the optimizer's live state, before the views (DCP writes through them into the same storage)
    live = None if optimizer is None else get_optimizer_state_dict(
        inner, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=False))
    dcp.load(state, checkpoint_id=str(checkpoint_dir))  # in place: every model tensor aliases its parameter
    if optimizer is not None:
        for name, entry in live["state"].items():
            for key, value in entry.items():
                loaded = state["optim"]["state"][name][key]
                if torch.is_tensor(value) and not value.dim():
                    value.copy_(loaded if torch.is_tensor(loaded) else torch.tensor(loaded))
        live["param_groups"] = state["optim"]["param_groups"]
        set_optimizer_state_dict(inner, optimizer, live, options=StateDictOptions(flatten_optimizer_state_dict=False))
