"""Gradient synchronisation contract for expert parallel x data parallel training.

Each rank runs forward and backward on its own batch with a loss that is the *mean* over that
rank's tokens (every rank the same number of tokens). After backward:

* a replicated parameter (attention, norms, embeddings, routers, shared experts) holds the gradient
  of its own rank's loss only. The unmodified model on the concatenated batch has the *mean* of the
  per-rank gradients, so these are all-reduced over the whole world and divided by the world size
  (what DDP does).
* an expert parameter lives on one rank of each EP group. The reverse all-to-all has already brought
  home the contributions of every rank of its EP group, each scaled by its own rank's 1/tokens, so
  it holds a *sum* over the EP group. Summing again over the replica group (the ranks holding the
  same experts in the other EP groups) covers the whole world; dividing by the world size gives the
  mean. Averaging expert gradients over the world instead (DDP on everything) would mix different
  experts; dividing only by the replica size would leave them ep_size times too large.

``sync_gradients(model, ep)`` applies exactly this, with one coalesced all-reduce per group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .groups import ExpertParallelGroup


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters sharded over EP (the per-expert weights of every expert-parallel holder)."""
    params = []
    for module in model.modules():
        if getattr(module, "hp_expert_parallel", None) is not None:
            params.extend(getattr(module, name) for name in module.hp_layout.weight_names)
    return params


def _all_reduce_mean(grads: list[torch.Tensor], group, divisor: int) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not False:
        dist.all_reduce(flat, group=group)
    flat /= divisor
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_gradients(model: nn.Module, ep: ExpertParallelGroup) -> None:
    """Make every gradient equal to the unmodified model's on the concatenated batch (see module doc)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    experts = {id(p) for p in expert_parameters(model)}
    expert_grads, replicated_grads = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:  # unused on this rank: still take part, so every rank reduces the same set
            p.grad = torch.zeros_like(p)
        (expert_grads if id(p) in experts else replicated_grads).append(p.grad)
    for dtype in sorted({g.dtype for g in replicated_grads}, key=str):
        _all_reduce_mean([g for g in replicated_grads if g.dtype == dtype], None, world)
    replica = ep.replica_group if ep.replica_size > 1 else False
    for dtype in sorted({g.dtype for g in expert_grads}, key=str):
        _all_reduce_mean([g for g in expert_grads if g.dtype == dtype], replica, world)
