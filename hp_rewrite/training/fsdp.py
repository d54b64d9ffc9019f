"""FSDP2 for an expert-parallel model: experts sharded over the expert-replica mesh, everything else
over the data-parallel mesh, so non-expert weights are no longer replicated on every rank.

A rank's experts are the same tensor only on the ranks holding the same experts (the expert-replica
group: world / ep ranks), so they are sharded there, as torchtitan, VeOmni and Megatron do; FSDP2
over the whole world would treat different experts as shards of one tensor. Gradient divisors follow
the contract of :mod:`hp_rewrite.sync.gradients`: an expert gradient already sums its EP group's
tokens, so it is summed over the replicas and divided by the *world* size
(``set_gradient_divide_factor``); the other weights are averaged over the world, FSDP's default.

Experts kept quantised (``dequantize=False``: frozen codes and scales, not a tensor FSDP2 can shard)
stay out of every FSDP2 unit, each rank holding its EP share as loaded; their adapters and everything
else are sharded as above.

The mesh has the dimensions ``("efsdp", "ep")`` (or ``("dp_replicate", "efsdp", "ep")``: experts
and the rest are then replicated over ``dp_replicate`` and sharded within it, HSDP). ``ep`` must be
the model's EP groups: consecutive ranks. Without a mesh, the one the model's EP groups were built
from (``auto_patch(plan, mesh=...)``, or the plan's over the world) is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard

from ..loading.record import info_of, rewritten_model
from ..runtime import installed
from ..runtime.compute.quantized import QuantizedWeight
from ..runtime.errors import ExpertParallelError
from ..runtime.group.groups import EP_DIM, backend_name, check_mesh
from ..sync.gradients import rank_local_modules
from .rewritten import peft_model_of


@dataclass(frozen=True)
class ShardedMeshes:
    """What :func:`fully_shard` sharded over: the user's (or built) mesh and its two views."""

    mesh: DeviceMesh
    experts: DeviceMesh  # the expert-replica dimensions
    dense: DeviceMesh  # every rank: data parallel for the non-expert weights
    kept: frozenset = frozenset()  # ids of experts kept quantised: left out of every FSDP2 unit (module doc)


def _views(mesh: DeviceMesh, kept: frozenset) -> ShardedMeshes:
    names = tuple(mesh.mesh_dim_names)
    experts = mesh[names[:-1]] if len(names) > 2 else mesh[names[0]]
    if "dp_replicate" in names:  # HSDP: replicate over dp_replicate, shard over the rest
        mesh[("efsdp", EP_DIM)]._flatten("hp_dp_shard")
        dense = mesh._get_root_mesh()[("dp_replicate", "hp_dp_shard")]
    else:
        dense = mesh._flatten("hp_dp")
    return ShardedMeshes(mesh, experts, dense, kept)


def _expert_placement(shard_size: int):
    """Shard(0) when the local experts split evenly over the ``shard_size`` ranks that shard them;
    else Shard(1), which avoids padding dim 0 (torchtitan and VeOmni do the same)."""

    def placement(p: nn.Parameter) -> Shard:
        return Shard(0) if p.shape[0] % shard_size == 0 or p.dim() < 2 else Shard(1)

    return placement


def _refuse_unshardable(inner: nn.Module, holders: list[nn.Module], what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ExpertParallelError(f"{what} needs torch.distributed initialised (launch with torchrun)")
    split = [type(h).__name__ for h in holders if installed.layout(h).split]
    if split:
        raise ExpertParallelError(
            f"{what}: {split[0]} holds its experts' weights in two sub-modules that its expert-parallel "
            "forward reads directly, beside its router; FSDP2 cannot unshard them around that forward. Train "
            "this model with DDP or hp_rewrite.sync_gradients (its experts are already split over the EP ranks)"
        )
    if any(installed.binding(h).options.defer_expert_grads for h in holders):
        raise ExpertParallelError(
            f"{what}: runtime.defer_expert_grads writes expert gradients after FSDP has reduced them; set "
            "runtime.defer_expert_grads: false in the plan to train with FSDP2"
        )


def _kept_in(module: nn.Module, views: ShardedMeshes) -> set | None:
    """The kept-quantised expert weights below ``module``: FSDP2 leaves them as they are."""
    kept = {p for p in module.parameters() if id(p) in views.kept}
    return kept or None


def _policies(mp_policy, reshard_after_forward, offload_policy) -> dict:
    return {"mp_policy": mp_policy or MixedPrecisionPolicy(), "reshard_after_forward": reshard_after_forward,
            "offload_policy": offload_policy or OffloadPolicy()}


def shard_experts(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    offload_policy: OffloadPolicy | None = None,
    what: str = "fully_shard",
) -> ShardedMeshes:
    """FSDP2 over each experts holder only, over the expert-replica mesh with the world size as its
    divisor (module doc). An FSDP2 applied afterwards to the layers and the root (:func:`fully_shard`,
    or an engine's, accelerate's) leaves these units alone and shards the rest. Collective."""
    inner = rewritten_model(model)
    info = info_of(model, what)
    ep = info.ep
    holders = [m for m in inner.modules() if installed.binding(m) is not None]
    _refuse_unshardable(inner, holders, what)
    mesh = mesh if mesh is not None else ep.mesh  # the mesh the model's EP groups come from
    check_mesh(mesh, ep.size)  # its 'ep' groups are then the model's: the same consecutive ranks
    views = _views(mesh, frozenset(id(p) for p in inner.parameters() if isinstance(p, QuantizedWeight)))
    common = _policies(mp_policy, reshard_after_forward, offload_policy)
    divisor = ep.dp_size  # the batches of one step (the ranks of a TP group share one)
    sum_only = "nccl" not in backend_name()  # gloo and hccl have no PREMUL_SUM: SUM, then scale
    shard_size = mesh["efsdp"].size()  # the experts' shard dimension (HSDP replicates over dp_replicate)
    for _, module in rank_local_modules(inner):  # each experts holder
        torch_fully_shard(module, mesh=views.experts, shard_placement_fn=_expert_placement(shard_size),
                          ignored_params=_kept_in(module, views), **common)
        module.set_gradient_divide_factor(float(divisor))
        # (only where a reduce-scatter runs: without one, torch 2.13 would then divide twice)
        if sum_only and shard_size > 1:
            module.set_force_sum_reduction_for_comms(True)
        for p in module.parameters():
            p.hp_ep_group = ep.group  # hp_rewrite.clip_grad_norm_: these norms also sum over the EP group
    for h in holders:
        installed.state_of(h).fsdp_sharded = True  # the engine guard accepts these DTensor experts
    info.fsdp = views
    return views


def fully_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    offload_policy: OffloadPolicy | None = None,
) -> nn.Module:
    """Apply FSDP2 to a rewritten model (module doc): experts first, each decoder layer, the root.

    Collective: every rank calls it, after the rewrite and before the optimizer is built. Returns
    the model (sharded in place). Clip its gradients with :func:`hp_rewrite.clip_grad_norm_`.
    """
    inner = rewritten_model(model)
    if info_of(model, "fully_shard").fsdp is not None:
        return model
    views = shard_experts(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                          offload_policy=offload_policy)
    common = _policies(mp_policy, reshard_after_forward, offload_policy)
    ep = info_of(model, "fully_shard").ep
    # with tp_size > 1 the dense parts shard over the data-parallel dimension of their ("dp", "tp") mesh
    # (2-D: FSDP2 over dp, DTensor TP within); the ranks of a TP group hold different shards
    dense = ep.tp_mesh["dp"] if ep.tp_size > 1 else views.dense
    layer_classes = set(getattr(inner, "_no_split_modules", None) or [])
    for module in inner.modules():
        if type(module).__name__ in layer_classes and module is not inner:
            torch_fully_shard(module, mesh=dense, ignored_params=_kept_in(module, views), **common)
    # the root: the outermost model (PEFT's PeftModel around it too), so that an engine given the model
    # afterwards (accelerate's prepare) finds it already sharded and keeps it as it is
    root = peft_model_of(model, "fully_shard", refuse_others=False) or inner
    torch_fully_shard(root, mesh=dense, ignored_params=_kept_in(root, views), **common)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def total_grad_norm(parameters, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of every gradient, each parameter counted once over the world: plain tensors and
    :class:`~hp_rewrite.sync.gradnorm.ExpertGrad` as they are, DTensors over their mesh, and the
    expert DTensors of :func:`fully_shard` over their EP group too."""
    from torch.distributed.tensor import DTensor

    grads = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in grads:
        g = p.grad
        mesh = g.device_mesh if isinstance(g, DTensor) else None
        groups.setdefault((id(mesh), id(getattr(p, "hp_ep_group", None))), []).append(p)
    parts = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        group = getattr(params[0], "hp_ep_group", None)
        if group is not None and isinstance(params[0].grad, DTensor):
            powered = norm.double() ** norm_type if norm_type != float("inf") else norm.double()
            op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
            dist.all_reduce(powered, op=op, group=group)
            norm = (powered if norm_type == float("inf") else powered ** (1.0 / norm_type)).to(norm.dtype)
        parts.append(norm)
    if not parts:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([_local(n).reshape(()).float() for n in parts]), norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for an expert-parallel model, sharded or not: the total
    norm counts every parameter once (:func:`total_grad_norm`), every rank scales by the same
    coefficient. torch's own refuses gradients on two meshes (the experts' and the rest's)."""
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        _local(p.grad).mul_(coef.to(p.grad.device))
    return total
