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

``reduce_gradients(model, ep)`` applies exactly this after backward, bucket by bucket (one bucket's copy
at a time; expert gradients without replicas are only scaled, never copied); :class:`GradientSync`
applies it during backward, bucket by bucket, like DDP.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..runtime import installed
from ..runtime.compute.experts import holder_of
from ..runtime.errors import ExpertParallelError
from ..runtime.group.groups import ExpertParallelGroup
from .gradnorm import mark_expert_grads

BUCKET_BYTES = 25 * 2**20  # DDP's default: large enough to amortise a collective, small enough to overlap


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters sharded over EP (the per-expert weights of every expert-parallel holder)."""
    params = []
    for module in model.modules():
        if installed.binding(module) is not None:
            params.extend(installed.layout(module).param(module, name) for name in installed.layout(module).weight_names)
    return params


def has_tuner_layers(model: nn.Module) -> bool:
    """Whether PEFT's tuner layers (modules with ``adapter_layer_names``: LoRA and the like) are in
    ``model``, put there by ``get_peft_model`` or otherwise, and not merged away."""
    return any(hasattr(m, "adapter_layer_names") for m in model.modules())


def rank_local_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module whose parameters exist only on this EP rank: the experts
    holders and whatever wraps them (LoRA adapters of the local experts), outermost first."""
    found, inside = [], set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        holder = holder_of(module)
        if holder is not None and holder is module and installed.layout(holder).split:
            # a block holding its experts (JetMoE's): only the two children with the expert weights are
            # rank-local; its router and output bias are replicated like any dense parameter
            for w in installed.layout(holder).weight_names:
                owner_path = w.rpartition(".")[0]
                owner = holder.get_submodule(owner_path)
                found.append((f"{name}.{owner_path}" if name else owner_path, owner))
                inside.update(id(m) for m in owner.modules())
            continue
        if holder is not None:
            found.append((name, module))
            inside.update(id(m) for m in module.modules())
    return found


def rank_local_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter that differs between the ranks of an EP group (expert weights, and adapters
    trained on them), in ``model.parameters()`` order: the same order on every rank."""
    local = {id(p) for _, m in rank_local_modules(model) for p in m.parameters()}
    return [p for p in model.parameters() if id(p) in local]


def trains_rank_local_only(model: nn.Module, wrapper: nn.Module | None = None) -> bool:
    """Whether ``wrapper`` (``model`` itself, or PEFT's or an engine's wrapper of it) trains something
    and every trainable parameter is rank-local (the experts or adapters on them): DDP would have
    nothing to manage, and torch refuses to build it."""
    trainable = [p for p in (model if wrapper is None else wrapper).parameters() if p.requires_grad]
    local = {id(p) for p in rank_local_parameters(model)}
    return bool(trainable) and all(id(p) in local for p in trainable)


def rank_local_names(model: nn.Module) -> list[str]:
    """Names (relative to ``model``) of the rank-local parameters and of the buffers of the modules
    holding them: what a data-parallel wrapper must neither broadcast nor average."""
    names = []
    for prefix, module in rank_local_modules(model):
        dot = f"{prefix}." if prefix else ""
        names += [dot + n for n, _ in module.named_parameters()]
        names += [dot + n for n, _ in module.named_buffers()]
    return names


def defers_expert_grads(model: nn.Module) -> bool:
    """Whether the model's expert weight gradients arrive at the end of backward, without hooks
    (``runtime.defer_expert_grads``, see :mod:`.deferred`)."""
    return any(
        installed.binding(m) is not None and installed.binding(m).options.defer_expert_grads
        for m in model.modules()
    )


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients in groups of at most ``bucket_bytes`` (a larger one alone)."""
    buckets, size = [[]], 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    return [b for b in buckets if b]


def _all_reduce_mean(grads: list[torch.Tensor], group, divisor: int, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum ``grads`` over ``group`` (``False``: nothing to sum with) and divide by ``divisor``, in place.

    One bucket's copy lives at a time (freed after the copy back); a gradient alone in its bucket is
    reduced in place, and without a group nothing is copied at all."""
    if not grads:
        return
    if group is False:
        torch._foreach_div_(grads, divisor)
        return
    for bucket in _buckets(grads, bucket_bytes):
        if len(bucket) == 1 and bucket[0].is_contiguous():
            dist.all_reduce(bucket[0], group=group)
            bucket[0].div_(divisor)
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat /= divisor
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        del flat


def reduce_gradients(model: nn.Module, ep: ExpertParallelGroup, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Make every gradient equal to the unmodified model's on the concatenated batch (see module doc),
    reducing in buckets of ``bucket_bytes`` (the plan's ``runtime.grad_bucket_mb``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    experts = {id(p) for p in rank_local_parameters(model)}
    params = [p for p in model.parameters() if p.requires_grad]
    replicated = [p for p in params if id(p) not in experts and not isinstance(p, DTensor)]
    for p in replicated:
        if p.grad is None:  # unused on this rank: still take part, so every rank reduces the same set
            p.grad = torch.zeros_like(p)
    for dtype in sorted({p.grad.dtype for p in replicated}, key=str):
        _all_reduce_mean([p.grad for p in replicated if p.grad.dtype == dtype], None, world, bucket_bytes)
    reduce_tensor_parallel_grads([p for p in params if id(p) not in experts and isinstance(p, DTensor)], ep,
                                 bucket_bytes)
    reduce_rank_local_grads([p for p in params if id(p) in experts], ep, bucket_bytes)


def reduce_tensor_parallel_grads(params: list[nn.Parameter], ep: ExpertParallelGroup,
                                 bucket_bytes: int = BUCKET_BYTES) -> None:
    """The TP-split parameters (DTensors over the TP group): a partial gradient (a norm fed this rank's
    sequence chunk or heads) is first summed over the group, then each rank's shard is averaged over the
    ranks holding the same shard (the data-parallel dimension of the dense mesh). A whole parameter
    (not a DTensor) gets the same gradient on every rank of its TP group: averaging it over the world,
    as :func:`reduce_gradients` does, is its mean over the batches."""
    if not params:
        return
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif tuple(p.grad.placements) != tuple(p.placements):
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        dp = ep.dp_size
        group = ep.tp_mesh["dp"].get_group() if dp > 1 else False
        locals_ = [p.grad.to_local() for p in params]
        for dtype in sorted({g.dtype for g in locals_}, key=str):
            _all_reduce_mean([g for g in locals_ if g.dtype == dtype], group, dp, bucket_bytes)


def reduce_rank_local_grads(params: list[nn.Parameter], ep: ExpertParallelGroup,
                            bucket_bytes: int = BUCKET_BYTES) -> None:
    """The rank-local half of the contract (module doc): summed over the expert replicas, divided by
    the world size, and made :class:`~.gradnorm.ExpertGrad` (global norms in ``clip_grad_norm_``).
    Every rank of the world calls it with the same parameters (one missing its gradient gets zeros)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    replica = ep.replica_group if ep.replica_size > 1 else False
    for dtype in sorted({p.grad.dtype for p in params}, key=str):  # the ranks of a TP group share a batch
        _all_reduce_mean([p.grad for p in params if p.grad.dtype == dtype], replica, ep.dp_size, bucket_bytes)
    mark_expert_grads(params, ep.group)


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None | bool  # None: the whole world; False: no reduction
    ready: set[int] = field(default_factory=set)  # ids of the parameters whose gradient is final
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None


class GradientSync:
    """:func:`reduce_gradients` overlapped with backward, the way DDP overlaps its all-reduce.

    Gradients are packed in fixed buckets of at most :data:`BUCKET_BYTES` (one kind: replicated or
    expert, one dtype; in reverse parameter order, about the order backward finishes them). A hook
    after each parameter's gradient accumulation marks it ready; a bucket's all-reduce starts
    (asynchronously) once the bucket and every bucket before it are ready, so every rank starts the
    same collectives in the same order. :meth:`wait` after ``backward()`` starts whatever is left (a
    parameter this rank did not use counts as a zero gradient, as in :func:`reduce_gradients`), waits,
    divides by the world size and writes the results into ``p.grad``: the same numbers as
    :func:`reduce_gradients`. For gradient accumulation, run the backward passes before the last one
    inside :meth:`no_sync`. Call :meth:`close` to remove the hooks.

    With ``runtime.defer_expert_grads`` the expert weight gradients are written at the end of backward,
    without hooks: their buckets come last and start in :meth:`wait`.
    """

    def __init__(self, model: nn.Module, ep: ExpertParallelGroup, bucket_bytes: int = BUCKET_BYTES,
                 guard=None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self._guard = guard  # sync.engines.EngineGuard: refuses to reduce again what DDP reduced
        self.buckets: list[_Bucket] = []
        self.overlapped = 0  # buckets of the last step whose all-reduce started during backward
        self._next = 0  # the first bucket not started yet
        self._syncing = True
        self._handles = []
        if not self.enabled:
            return
        if ep.tp_size > 1:
            raise ExpertParallelError(
                "GradientSync with tp_size > 1 is not supported: call hp_rewrite.sync_gradients(model) after "
                "backward (it reduces the TP-split parameters over their data-parallel ranks)"
            )
        self.world = dist.get_world_size()
        self._ep_group = ep.group
        experts = {id(p) for p in rank_local_parameters(model)}
        self._local = [p for p in model.parameters() if id(p) in experts and p.requires_grad]
        # expert gradients: summed over the replicas of the same experts (nothing to sum with one replica)
        expert_group = ep.replica_group if ep.replica_size > 1 else False
        params = [p for p in model.parameters() if p.requires_grad]
        open_buckets: dict[tuple, tuple[list[nn.Parameter], int]] = {}
        for p in reversed(params):  # about the order backward finishes them
            key = (id(p) in experts, p.dtype)
            members, size = open_buckets.get(key, ([], 0))
            if members and size + p.numel() * p.element_size() > bucket_bytes:
                self.buckets.append(_Bucket(members, expert_group if key[0] else None))
                members, size = [], 0
            open_buckets[key] = (members + [p], size + p.numel() * p.element_size())
        for (is_expert, _), (members, _) in open_buckets.items():
            self.buckets.append(_Bucket(members, expert_group if is_expert else None))
        hooked = params
        if defers_expert_grads(model):  # no hook sees a deferred gradient: those buckets go last
            self.buckets.sort(key=lambda b: id(b.params[0]) in experts)
            hooked = [p for p in params if id(p) not in experts]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in hooked]

    def _ready(self, p: nn.Parameter) -> None:
        if not self._syncing:
            return
        if self._guard is not None:
            self._guard.refuse_manual_sync("GradientSync")
        bucket = self._bucket_of[id(p)]
        if id(p) in bucket.ready:
            raise RuntimeError(
                "GradientSync: a second backward() before wait(); call wait() after every backward, or run "
                "the backward passes of an accumulation (all but the last) inside no_sync()"
            )
        bucket.ready.add(id(p))
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._start(self.buckets[self._next])

    def _start(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            if p.grad is None:  # unused on this rank: still take part, so every rank reduces the same set
                p.grad = torch.zeros_like(p)
        if bucket.group is not False:  # with nothing to reduce with, wait() only scales the gradients
            bucket.buffer = torch.cat([p.grad.reshape(-1) for p in bucket.params])
            bucket.work = dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True)
        self._next += 1

    def wait(self) -> None:
        """Finish this step's reductions; afterwards every ``p.grad`` follows the contract."""
        if not self.enabled:
            return
        if self._guard is not None:
            self._guard.refuse_manual_sync("GradientSync")
        self.overlapped = self._next
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
        for bucket in self.buckets:
            if bucket.buffer is None:
                torch._foreach_div_([p.grad for p in bucket.params], self.world)
                bucket.ready.clear()
                continue
            if bucket.work is not None:
                bucket.work.wait()
            bucket.buffer /= self.world
            offset = 0
            for p in bucket.params:
                p.grad.copy_(bucket.buffer[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            bucket.ready.clear()
            bucket.buffer = bucket.work = None
        self._next = 0
        mark_expert_grads(self._local, self._ep_group)  # global norms in clip_grad_norm_
        if self._guard is not None:
            self._guard.mark_reduced()  # a later backward adds to final values (EngineGuard._unreduce)

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients (the first micro-batches of an accumulation)."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
