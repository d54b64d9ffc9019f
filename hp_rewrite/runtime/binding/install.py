"""Turn an experts holder into an expert-parallel one, in place.

After :func:`install_expert_parallel` the module keeps only its local experts and its ``forward``
accepts either

* the transformers experts contract ``(hidden [T,H], top_k_index [T,K], top_k_weights [T,K]) -> [T,H]``
  with *global* expert ids: the whole routed pipeline runs inside the call (experts-level rewrite, the
  model's own router and shared code stay as they are); or
* a :class:`LocalBatch` from :func:`experts_and_combine`: only the local expert compute (block-level
  rewrite; calling through the module keeps FSDP hooks firing).

What it installs lives in :mod:`hp_rewrite.runtime.installed`: the original bound forward stays
reachable as ``installed.original_forward(module)``; after every call, ``installed.last_stats(module)``
holds the last dispatch's :class:`DispatchStats` (device tensors, no host sync).
"""

from __future__ import annotations

import types
from dataclasses import replace

import torch
from torch import nn

from ... import kernels
from .. import installed
from ..balance import replicas
from ..compute import expert_modules
from ..compute.experts import (
    ExpertsLayout,
    LocalBatch,
    experts_implementation_of,
    holder_of,
    keep_local_experts,
)
from ..errors import ExpertParallelError
from ..group.groups import ExpertParallelGroup, ExpertPlacement
from ..options import RuntimeOptions
from ..overlap.context import ExchangeRuntime
from ..pipeline.dispatch import dispatch, experts_and_combine
from ..pipeline.layer import ExpertParallelBinding
from ..routing.routers import from_dispatch_masks


def expert_parallel_forward(self: nn.Module, hidden, top_k_index=None, top_k_weights=None,
                            eval_scale: float = 1.0) -> torch.Tensor:
    """The forward of an installed experts holder: the only experts-level forward (the experts-level
    archetype's generated function calls it). ``top_k_index`` may also be one-hot dispatch masks
    ``[T, K, E]`` (Switch Transformers'); ``eval_scale`` multiplies the output in eval mode."""
    if isinstance(hidden, LocalBatch):  # with runtime.balance, lending from here (its weights as this call sees them)
        return replicas.local_forward(self, hidden, installed.layout(self))
    if top_k_index is not None and top_k_index.dim() == 3 and top_k_weights.dim() == 2 and \
            top_k_index.shape[-1] == installed.binding(self).num_experts:  # masks [T, K, E], weights [T, K]
        top_k_index, top_k_weights = from_dispatch_masks(top_k_index, top_k_weights)
    state = dispatch(hidden, top_k_index, top_k_weights, binding=installed.binding(self))
    out = experts_and_combine(state, self, via_call=False)
    if eval_scale != 1.0 and not self.training:
        out = out * eval_scale
    if hidden.dim() > 2:  # [B, S, H] in, [B, S, H] out (DBRX)
        out = out.view(hidden.shape)
    # Never a view: under FSDP2 (which wraps this holder) an in-place op on a returned view would drop
    # the module's pre-backward hook, and with it the gradient's reduce-scatter, without an error.
    # (Compiled, where a tensor's view-ness is not known while tracing: always a copy.)
    return out.clone() if torch.compiler.is_compiling() or out._is_view() else out


def binding_of(experts: nn.Module) -> ExpertParallelBinding:
    """The EP binding of an installed experts holder, or of the holder a wrapper (PEFT's
    ``ParamWrapper``) keeps as ``base_layer``: what generated block code dispatches with."""
    holder = holder_of(experts)
    if holder is None:
        raise ExpertParallelError(f"{type(experts).__name__} is not an expert-parallel experts holder")
    return installed.binding(holder)


def install_expert_parallel(
    experts: nn.Module,
    *,
    num_experts: int,
    ep: ExpertParallelGroup,
    options: RuntimeOptions | None = None,
    shard: bool = True,
    placement: ExpertPlacement | None = None,
    runtime: ExchangeRuntime | None = None,
    bind_forward: bool = True,
) -> nn.Module:
    """Make ``experts`` expert-parallel. ``shard=False`` when it already holds only its local experts.

    ``placement`` says which experts this rank keeps (default: consecutive blocks of experts).
    ``runtime``: the deferred-gradient queue and turn hook the model's layers share (default: one of
    its own). ``bind_forward=False`` keeps the module's forward: a block holding its experts itself
    (JetMoE's) gets the generated block forward instead.
    """
    options = options or RuntimeOptions()
    placement = placement or ExpertPlacement(num_experts, ep.size, ep.rank)
    if (placement.num_experts, placement.ep_size, placement.ep_rank) != (num_experts, ep.size, ep.rank):
        raise ExpertParallelError(
            f"{type(experts).__name__}: placement for {placement.num_experts} experts at EP rank "
            f"{placement.ep_rank}/{placement.ep_size}, but the holder has {num_experts} experts at EP rank "
            f"{ep.rank}/{ep.size}"
        )
    layout = ExpertsLayout.of(experts)
    if installed.binding(experts) is not None:
        raise RuntimeError(f"{type(experts).__name__} is already expert-parallel")
    _, problem = kernels.compute_for(options.compute, experts_implementation_of(experts))
    if problem is not None:  # here, before anything is sharded; a later set_experts_implementation: at forward
        raise ExpertParallelError(f"{type(experts).__name__}: {problem}")
    if layout.modules and options.defer_expert_grads:
        raise ExpertParallelError(
            f"runtime.defer_expert_grads: {type(experts).__name__} keeps its experts as modules, whose weights the "
            "grouped GEMMs take stacked (a copy per forward), so their gradients cannot be deferred; set "
            "runtime.defer_expert_grads: false for this model")
    if options.balance != "off" and ep.size > 1 and (layout.modules or layout.flat or layout.split):
        raise ExpertParallelError(
            f"runtime.balance: auto: {type(experts).__name__} holds its experts as modules or as flat or split "
            "weights; only stacked 3-D expert weights are lent to other ranks so far. Set runtime.balance: off")
    if layout.modules and len(layout.expert_keys) != num_experts:
        raise ExpertParallelError(f"{type(experts).__name__} holds {len(layout.expert_keys)} expert modules, "
                                  f"expected num_experts={num_experts}")
    if shard and ep.size > 1:
        keep_local_experts(experts, num_experts, placement.local_experts)
    if layout.modules:  # the expert modules kept, under their original keys, in local order
        layout = replace(layout, held_keys=tuple(layout.expert_keys[e] for e in placement.local_experts))
        expert_modules.with_forward_class(experts)
    installed.set_state(experts, installed.HolderState(
        ExpertParallelBinding(ep, placement, options, runtime or ExchangeRuntime(), layout.zero_experts), layout))
    if bind_forward:
        installed.keep_original_forward(experts)
        experts.forward = types.MethodType(expert_parallel_forward, experts)
    return experts


def exchange_runtimes(model: nn.Module) -> list[ExchangeRuntime]:
    """The exchange runtimes of the holders installed in ``model`` (one for a rewritten model)."""
    found: dict[int, ExchangeRuntime] = {}
    for m in model.modules():
        binding = installed.binding(m)
        if binding is not None:
            found.setdefault(id(binding.runtime), binding.runtime)
    return list(found.values())


def expert_weights(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every expert weight of the holders installed in ``model``: its parameter name in the model ->
    (holder, its name below the holder; a path for flat layouts such as DBRX's ``mlp.w1``)."""
    return {f"{path}.{w}" if path else w: (h, w) for path, h in model.named_modules()
            if installed.binding(h) is not None for w in installed.layout(h).weight_names}


def local_rows(holder: nn.Module, weight: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, an unsharded tensor of the holder's ``weight`` (the reference
    model's weight or gradient): its experts' rows, plus the zero experts' rows every rank keeps.
    Experts held as modules keep the unmodified model's names: ``full`` is the local tensor already."""
    layout, placement = installed.layout(holder), installed.binding(holder).placement
    if layout.modules:
        return full
    rows = list(layout.rows_of(weight, placement.local_experts, placement.num_experts))
    return layout.stored(layout.per_expert(full)[rows])
