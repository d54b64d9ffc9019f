"""Global gradient norms of rank-local expert weights, inside the plain ``clip_grad_norm_``.

Each EP rank holds the gradients of its own experts only. ``torch.nn.utils.clip_grad_norm_`` (what
transformers ``Trainer`` and accelerate call) sums the squares of the gradients it sees, so on an
expert-parallel model every rank would compute a different, partial norm, clip by a different
coefficient and let its replicated weights drift from the other ranks'. DTensor expert weights
would make the norm global, but torch refuses a norm over a mix of DTensors and plain tensors,
and DDP refuses DTensor parameters.

So the gradient of a rank-local parameter is an :class:`ExpertGrad`: an ordinary tensor (same
storage, same kernels, no dispatch key) whose torch *norm* functions return the norm of the whole
parameter over its EP group. ``clip_grad_norm_`` then counts every expert exactly once and every
replicated weight once, and every rank computes the same total. Everything else (optimizer steps,
``mul_`` by the clip coefficient, accumulation) runs as on a plain tensor and returns plain tensors.

The norm of an :class:`ExpertGrad` is a collective over its EP group: every rank of the group must
ask for it (``clip_grad_norm_`` on every rank does); elementwise reductions (``sum``, ``pow``) stay
local.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


class ExpertGrad(torch.Tensor):
    """The gradient of a rank-local expert parameter (see module doc). ``hp_group`` is its EP group."""

    hp_group: dist.ProcessGroup | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FULL_NORMS:
            return _full_norm(func, args, kwargs)
        if func is torch._foreach_norm:
            return _foreach_norm(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def mark_expert_grads(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Make each ``p.grad`` an :class:`ExpertGrad` over ``group`` (no copy). No-op without a group."""
    if group is None:
        return
    for p in params:
        g = p.grad
        if g is None or (type(g) is ExpertGrad and g.hp_group is group):
            continue
        wrapped = g.as_subclass(ExpertGrad)
        wrapped.hp_group = group
        p.grad = wrapped


def _norm_args(func, args, kwargs) -> tuple[torch.Tensor, float, bool]:
    """(tensor, ord, whole tensor?) of a norm call; only a norm over every element is made global."""
    x = args[0]
    if func is torch.linalg.vector_norm:
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
    else:  # torch.norm / Tensor.norm
        ord_ = args[1] if len(args) > 1 else kwargs.get("p", "fro")
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        ord_ = 2 if ord_ in ("fro", None) else ord_
    whole = dim is None and isinstance(ord_, (int, float)) and not kwargs.get("keepdim", False)
    return x, float(ord_) if whole else 0.0, whole


def _combine(local_norms: torch.Tensor, ord_: float, group) -> torch.Tensor:
    """Norms of whole parameters from each rank's norm of its own rows (one collective)."""
    if ord_ == math.inf:
        out = local_norms.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        return out
    if ord_ == -math.inf:
        out = local_norms.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MIN, group=group)
        return out
    if ord_ == 0:
        out = local_norms.clone()
        dist.all_reduce(out, group=group)
        return out
    powered = local_norms.double() ** ord_  # in float64: the p-th power of a float32 norm can overflow
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / ord_)).to(local_norms.dtype)


def _full_norm(func, args, kwargs) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        local = func(*args, **kwargs)
    x, ord_, whole = _norm_args(func, args, kwargs)
    if not whole or type(x) is not ExpertGrad or x.hp_group is None:
        return local
    return _combine(local, ord_, x.hp_group)


def _foreach_norm(args, kwargs) -> list[torch.Tensor]:
    tensors = list(args[0])
    ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    with torch._C.DisableTorchFunctionSubclass():
        norms = list(torch._foreach_norm(tensors, *args[1:], **kwargs))
    by_group: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if type(t) is ExpertGrad and t.hp_group is not None:
            by_group.setdefault(id(t.hp_group), []).append(i)
    for indices in by_group.values():  # one collective per EP group, in first-seen order on every rank
        combined = _combine(torch.stack([norms[i] for i in indices]), ord_, tensors[indices[0]].hp_group)
        for j, i in enumerate(indices):
            norms[i] = combined[j]
    return norms


_FULL_NORMS = (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm)
