"""What hp-rewrite installs on a model's modules, read and written here only.

An experts holder made expert-parallel carries one :class:`HolderState`, set once at install (its
binding, its weights' layout, its own forward) and completed later by the layers that need it (the
router it belongs to, the routing counts, the last dispatch's statistics, FSDP2's sharding). A
rewritten block keeps its own forward. Every other module reads them through the functions below,
which look at the module's own attributes only: a wrapper that forwards attribute lookups (PEFT's
``PeftModel`` and ``LoraModel`` forward to the model they wrap) never passes for what it wraps. A
wrapper that holds a holder (PEFT's ``ParamWrapper`` as ``base_layer``, its ``ModulesToSaveWrapper``
as ``original_module``) is resolved explicitly, by :func:`hp_rewrite.runtime.compute.experts.holder_of`.

This module imports nothing of the runtime at run time (the types are for readers), so every room can
use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .compute.experts import ExpertsLayout
    from .pipeline.dispatch import DispatchStats
    from .pipeline.layer import ExpertParallelBinding
    from .routing.routing_load import ExpertLoad, RouterOf

#: the attributes, on the modules themselves (a new name would make a missed reader fail loudly)
_HOLDER = "hp_ep"
_BLOCK_FORWARD = "hp_original_forward"
_STATS = "hp_last_stats"  # a holder's, or an experts module's called by moe_forward without an install


@dataclass(eq=False, slots=True)
class HolderState:
    """An installed experts holder's state: ``binding`` and ``layout`` fixed at install, the rest set
    once by the layer that owns it. (The last dispatch's statistics, replaced on every forward, sit
    beside it: :func:`set_last_stats`.)"""

    binding: ExpertParallelBinding
    layout: ExpertsLayout
    original_forward: Callable | None = None  # the holder's own forward, when install replaced it
    router: RouterOf | None = None  # the block's router, for aux losses, bias updates and replay
    load: ExpertLoad | None = None  # the routing counts of the step, when the plan tracks routing
    fsdp_sharded: bool = False  # hp_rewrite.fully_shard sharded it over the expert replicas


def set_state(holder: nn.Module, state: HolderState) -> None:
    """Make ``holder`` an installed holder (once)."""
    if state_of(holder) is not None:
        raise RuntimeError(f"{type(holder).__name__} is already expert-parallel")
    vars(holder)[_HOLDER] = state


def state_of(module: nn.Module) -> HolderState | None:
    """``module``'s state if it is an installed experts holder itself, else None."""
    return vars(module).get(_HOLDER)


def is_holder(module: nn.Module) -> bool:
    return state_of(module) is not None


def binding(module: nn.Module) -> ExpertParallelBinding | None:
    """The EP binding of an installed holder (None for any other module)."""
    state = state_of(module)
    return None if state is None else state.binding


def layout(module: nn.Module) -> ExpertsLayout | None:
    """The weights' layout of an installed holder (None for any other module)."""
    state = state_of(module)
    return None if state is None else state.layout


def router(module: nn.Module) -> RouterOf | None:
    state = state_of(module)
    return None if state is None else state.router


def routing_load(module: nn.Module) -> ExpertLoad | None:
    state = state_of(module)
    return None if state is None else state.load


def fsdp_sharded(module: nn.Module) -> bool:
    state = state_of(module)
    return state is not None and state.fsdp_sharded


def holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, holder)`` of every installed experts holder in ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if state_of(m) is not None]


def set_last_stats(module: nn.Module, stats: DispatchStats) -> None:
    """The last dispatch's statistics (device tensors, no host sync), replaced on every forward."""
    vars(module)[_STATS] = stats


def last_stats(module: nn.Module) -> DispatchStats | None:
    return vars(module).get(_STATS)


def keep_original_forward(module: nn.Module) -> None:
    """Keep ``module``'s own forward before a rewrite replaces it: a holder's in its state, a block's
    beside it (the escape hatch :func:`original_forward` reads)."""
    state = state_of(module)
    if state is not None:
        state.original_forward = module.forward
    else:
        vars(module)[_BLOCK_FORWARD] = module.forward


def original_forward(module: nn.Module) -> Callable | None:
    """The forward a holder or a block had before the rewrite replaced it (None if it was not)."""
    state = state_of(module)
    return state.original_forward if state is not None else vars(module).get(_BLOCK_FORWARD)


# the model's router losses (routing.aux_loss: global, routing.z_loss_coef), around its forward

_LOSSES = "hp_router_losses"
_UNWRAPPED_FORWARD = "hp_forward_without_router_losses"


def set_router_losses(model: nn.Module, losses: object) -> None:
    vars(model)[_LOSSES] = losses


def router_losses(model: nn.Module):
    """The :class:`~.routing.aux_loss.RouterLosses` of ``model`` itself (None when the plan asks for none)."""
    return vars(model).get(_LOSSES)


def keep_forward_without_router_losses(model: nn.Module) -> None:
    vars(model)[_UNWRAPPED_FORWARD] = model.forward


def forward_without_router_losses(model: nn.Module) -> Callable:
    return vars(model)[_UNWRAPPED_FORWARD]
