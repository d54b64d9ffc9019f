"""An expert-parallel model inside the data-parallel engines users wrap around it.

DDP (what transformers ``Trainer`` and ``accelerate.prepare`` build on several ranks) averages every
gradient over the world and, when it is built, broadcasts rank 0's parameters to the others. Both
are right for the replicated weights and wrong for the expert weights, which differ from rank to
rank. :class:`EngineGuard`, installed on every rewritten model, splits the work the way Megatron and
torchtitan do:

* the model's ``_ddp_params_and_buffers_to_ignore`` lists the rank-local parameters (expert weights
  and adapters trained on them), so a DDP built around the model (or around PEFT's or
  ``torch.compile``'s wrapper of it) neither broadcasts nor averages them;
* at the end of a backward that DDP synchronises (not inside ``no_sync()``), the guard sums those
  gradients over the expert-replica group and divides by the world size, the divisor DDP uses for the
  rest: each already holds the sum over its EP group (the reverse all-to-all brought the other
  ranks' tokens home), so the result is the unmodified model's full-batch gradient;
* their gradients are :class:`~.gradnorm.ExpertGrad`, so the plain ``clip_grad_norm_`` counts each
  expert once and every rank clips by the same coefficient.

What cannot be made exact is refused at the forward that would use it, naming the fix: a DDP that
manages rank-local parameters or was built before the rewrite, a DDP over part of the world, FSDP
(FSDP1 or FSDP2's ``fully_shard``) over rank-local weights, DDP with the ``Interleaver``, and manual
gradient synchronisation on top of DDP.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..runtime import installed
from ..runtime.binding.install import exchange_runtimes
from ..runtime.errors import ExpertParallelError
from ..runtime.group.groups import ExpertParallelGroup
from ..runtime.overlap.turns import in_interleaved_step
from .gradients import (
    BUCKET_BYTES,
    rank_local_modules,
    rank_local_names,
    rank_local_parameters,
    reduce_gradients,
    reduce_rank_local_grads,
    trains_rank_local_only,
)

# Where wrappers put the model: PEFT (PeftModel -> LoraModel -> model) and torch.compile
# (OptimizedModule._orig_mod). A DDP built around a wrapper reads the ignore list through the
# wrapper's attribute fallback, so the names are listed under each prefix.
WRAPPER_PREFIXES = ("", "base_model.model.", "_orig_mod.", "_orig_mod.base_model.model.")


class RankLocalNames:
    """The model's ``_ddp_params_and_buffers_to_ignore``: iterated when a DDP is built (after any
    PEFT wrapping), so adapters added on the experts since the rewrite are listed too."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model  # a strong reference: a deep copy of the model gets its own copy of this

    def __iter__(self):
        if trains_rank_local_only(self._model):
            raise ExpertParallelError(
                "DistributedDataParallel around a model whose every trainable parameter is rank-local (adapters "
                "on the experts only): DDP would have nothing to manage (torch refuses to build it). Train it "
                "without DDP: hp_rewrite.sync_gradients(model) after backward in a loop, or a Trainer / "
                "Accelerator passed to hp_rewrite.prepare_trainer / prepare_accelerator, which leave DDP out"
            )
        names = rank_local_names(self._model)
        # TP-split parameters too, so that DDP can be built and the guard's clear refusal reached
        names += [n for n, p in self._model.named_parameters() if isinstance(p, DTensor)]
        return iter([prefix + n for prefix in WRAPPER_PREFIXES for n in names])


def _ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _tensors_in(value, depth: int = 0) -> list[torch.Tensor]:
    """The tensors of a model output (ModelOutput, tuple, dict), not looking into caches."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    return []


#: the config fields of LayerDrop (fairseq's random skipping of whole layers in training)
LAYERDROP_FIELDS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def refuse_layerdrop(model: nn.Module) -> None:
    """LayerDrop in training at EP > 1: each rank draws on its own which layers to skip, and a layer
    that one rank skips leaves its expert-parallel exchange without that rank's share (a hang, or other
    rows exchanged). Nothing ties the draws together, so it is refused, not hoped for."""
    config = getattr(model, "config", None)
    for field in LAYERDROP_FIELDS:
        p = getattr(config, field, None)
        if isinstance(p, (int, float)) and p > 0:
            raise ExpertParallelError(
                f"{type(config).__name__}.{field}={p} is active in training: each rank draws the layers it "
                "skips on its own, and an expert-parallel layer's exchange needs every rank of its EP group. "
                f"Set {field}=0 (config field, before loading) to train expert-parallel, or train with ep_size: 1"
            )


_FOREIGN_FSDP = (
    "{name} is sharded by FSDP (FSDP1, or FSDP2 not applied by hp-rewrite): FSDP over the world treats each "
    "rank's own experts as shards of one tensor and mixes different experts. Shard the rewritten model with "
    "hp_rewrite.fully_shard(model); through accelerate, call hp_rewrite.prepare_accelerator(accelerator) before "
    "prepare; through Trainer / TRL, hp_rewrite.prepare_trainer(trainer) before train() (fsdp_config version 2); "
    "or train with DDP"
)


def _modules_above(model: nn.Module, holders: list[nn.Module]) -> dict[nn.Module, list[nn.Module]]:
    """Each experts holder -> the modules that contain it (the holder itself included), root first."""
    paths = {id(m): name for name, m in model.named_modules()}
    above = {}
    for holder in holders:
        parts = paths[id(holder)].split(".") if paths[id(holder)] else []
        above[holder] = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
    return above


class EngineGuard:
    """Per rewritten model: the DDP contract for rank-local parameters and the refusals (module doc).

    ``under_ddp``: the last forward ran inside a DistributedDataParallel; ``ddp_sync``: its backward
    synchronises gradients. ``reductions`` counts the end-of-backward reductions (tests, diagnostics).
    """

    def __init__(self, model: nn.Module, ep: ExpertParallelGroup) -> None:
        self.ep = ep
        self.under_ddp = False
        self.ddp_sync = False
        self.reductions = 0
        self._model = model
        self._holders = [m for m in model.modules() if installed.binding(m) is not None]
        self._above = None  # holder -> the modules containing it (at the first forward)
        self._checked = weakref.WeakKeyDictionary()  # DDP wrapper -> wraps this model (validated)
        self._tasks: set[int] = set()  # backward passes (graph tasks) started and not finished
        self._reduced = False  # the rank-local gradients hold reduced (final) values
        self._engine_sync = None  # set by sync_without_ddp: whether this backward synchronises
        self._sync_everything = None  # set by sync_without_ddp: reduce every gradient in buckets of these bytes
        model._ddp_params_and_buffers_to_ignore = RankLocalNames(model)
        self._handles = [
            model.register_forward_pre_hook(self._before_forward),
            model.register_forward_hook(self._after_forward),
        ]

    def __deepcopy__(self, memo) -> EngineGuard:
        """A deep copy of the model (a frozen reference model, an EMA copy) gets a guard of its own,
        whose hooks the copy's hook dictionaries already point to."""
        twin = copy.copy(self)
        memo[id(self)] = twin
        twin._model = copy.deepcopy(self._model, memo)
        twin._holders = copy.deepcopy(self._holders, memo)
        twin._above = None  # the copy is not complete yet: found at its first forward
        twin._checked, twin._tasks, twin._handles = weakref.WeakKeyDictionary(), set(), []
        twin.under_ddp = twin.ddp_sync = twin._reduced = False
        twin._engine_sync, twin._sync_everything = None, None
        twin.reductions = 0
        return twin

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- forward ---------------------------------------------------------------------------------

    @torch.compiler.disable
    def _before_forward(self, module: nn.Module, args) -> None:
        self._refuse_sharded_experts()
        if module.training and self.ep.size > 1:
            refuse_layerdrop(module)
        ddp = _ddp_class()._get_active_ddp_module()
        if ddp is not None and ddp not in self._checked:  # once per DDP: does it wrap this model?
            wraps = any(m is module for m in ddp.module.modules())
            if wraps:
                self._check_ddp(ddp, module)
            self._checked[ddp] = wraps
        if ddp is None or not self._checked[ddp]:
            # an engine that leaves DDP out (every trainable parameter rank-local, or a model split over TP
            # groups): the guard synchronises here
            self.under_ddp = self._engine_sync is not None
            self.ddp_sync = self.under_ddp and torch.is_grad_enabled() and self._engine_sync()
            return
        if in_interleaved_step():
            raise ExpertParallelError(
                "hp_rewrite.Interleaver runs several backward passes of one rank at once, which "
                "DistributedDataParallel does not support: use the Interleaver in a loop without DDP and "
                "synchronise with hp_rewrite.sync_gradients(model)"
            )
        self.under_ddp = True
        self.ddp_sync = torch.is_grad_enabled() and ddp.require_backward_grad_sync

    @torch.compiler.disable
    def _after_forward(self, module: nn.Module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if tensors:  # the first gradient that reaches an output: this forward's backward starts
            sync = self.under_ddp and self.ddp_sync
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: self._on_backward(sync), mode="any")

    def _refuse_sharded_experts(self) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        if self._above is None:
            self._above = _modules_above(self._model, self._holders)
        for holder in self._holders:
            if installed.fsdp_sharded(holder):  # hp_rewrite.fully_shard: over the expert replicas
                if in_interleaved_step():
                    raise ExpertParallelError(
                        "hp_rewrite.Interleaver runs several forward and backward passes of one rank at once, "
                        "which FSDP2 does not support: use the Interleaver without fully_shard"
                    )
                continue
            # FSDP2 over a module containing the holder manages its experts (FSDP2 unshards them before
            # this hook runs when that module is the model itself, so the weights alone cannot tell)
            if any(isinstance(m, FSDPModule) for m in self._above[holder]):
                raise ExpertParallelError(_FOREIGN_FSDP.format(
                    name=f"{type(holder).__name__}.{installed.layout(holder).weight_names[0]}"))
            for name in installed.layout(holder).weight_names:
                owner, leaf = installed.layout(holder).owner_of(holder, name)  # flat layouts: a path below the holder
                p = owner._parameters.get(leaf)
                # FSDP1 leaves no parameter (or, with use_orig_params, a plain view of its flat
                # parameter) during forward; fully_shard a DTensor
                if not isinstance(p, nn.Parameter) or isinstance(p, DTensor) or getattr(p, "_fsdp_flattened", False):
                    raise ExpertParallelError(_FOREIGN_FSDP.format(name=f"{type(holder).__name__}.{name}"))

    def _check_ddp(self, ddp: nn.Module, model: nn.Module) -> None:
        world = dist.get_world_size()
        if self.ep.tp_size > 1:
            raise ExpertParallelError(
                f"DistributedDataParallel around a model split over TP groups (tp_size {self.ep.tp_size}) would "
                "average different TP shards over the world: train it with hp_rewrite.sync_gradients(model) after "
                "backward, shard it with hp_rewrite.fully_shard(model) (data parallel x tp), or let "
                "hp_rewrite.prepare_trainer / prepare_accelerator prepare the engine (they leave DDP out)"
            )
        if dist.get_world_size(ddp.process_group) != world:
            raise ExpertParallelError(
                f"DistributedDataParallel runs over {dist.get_world_size(ddp.process_group)} of the {world} "
                "ranks: expert-parallel models need DDP over the whole world (the default process group)"
            )
        current = {id(p) for p in ddp.module.parameters()}
        if any(id(p) not in current for p in ddp._module_parameters):
            raise ExpertParallelError(
                "this DistributedDataParallel was built before hp-rewrite rewrote the model: it still holds "
                "the full expert weights that were replaced by this rank's experts. Rewrite (auto_patch / "
                "from_pretrained / rewrite_model) first, then wrap the rewritten model in DDP"
            )
        managed = {id(p) for p in ddp._module_parameters}
        names = {id(p): n for n, p in model.named_parameters()}
        bad = [names.get(id(p), "?") for p in rank_local_parameters(model) if id(p) in managed]
        if bad:
            raise ExpertParallelError(
                f"DistributedDataParallel manages {len(bad)} rank-local expert parameter(s) ({bad[0]}, ...): "
                "when it was built it copied rank 0's experts over the other ranks', and it would average "
                "different experts' gradients. Build DDP around the rewritten model, a PEFT model of it, or "
                "torch.compile of it (their rank-local parameters are ignored automatically); for another "
                "wrapper call DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapper, "
                "hp_rewrite.rank_local_names(wrapper)) before building DDP, and load the weights again"
            )

    # -- backward ----------------------------------------------------------------------------------

    def _on_backward(self, sync: bool) -> None:
        task = torch._C._current_graph_task_id()
        if task in self._tasks:
            return
        self._tasks.add(task)
        self._unreduce()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish(task, sync))

    def mark_reduced(self) -> None:
        """The rank-local gradients now hold final values (after a reduction): see :meth:`_unreduce`."""
        self._reduced = True

    def _unreduce(self) -> None:
        """Before a backward adds to gradients that a reduction already made final, scale those by the
        data-parallel size over the replica size (the EP size over the TP size), so that the next reduction
        (a sum over the replicas, divided by the data-parallel size) gives them back unchanged: final values
        are equal on every replica. So an accumulation that reduces after every micro-batch (DDP without
        ``no_sync()``, or ``sync_gradients`` called each time) gives the same gradients as one reduction at
        the end; without this the earlier micro-batches would end up divided once more."""
        if not self._reduced:
            return
        self._reduced = False
        factor = self.ep.dp_size / self.ep.replica_size
        if factor != 1:
            for p in rank_local_parameters(self._model):
                if p.grad is not None:
                    p.grad.mul_(factor)

    def _finish(self, task: int, sync: bool) -> None:
        """End of a backward; when DDP (or an engine without it) synchronises it, the rank-local gradients
        are summed over the replicas and divided by the data-parallel size (the world size without TP); an
        engine without DDP around a TP model reduces every gradient (:meth:`sync_without_ddp`)."""
        self._tasks.discard(task)
        if not sync:
            return
        for runtime in exchange_runtimes(self._model):  # runtime.defer_expert_grads: the deferred parts first
            runtime.weight_grads.flush()
        if self._sync_everything:
            reduce_gradients(self._model, self.ep, self._sync_everything)
        else:
            reduce_rank_local_grads([p for p in rank_local_parameters(self._model) if p.requires_grad], self.ep)
        self.reductions += 1
        self._reduced = True

    def sync_without_ddp(self, synchronises, everything: bool = False, bucket_bytes: int = BUCKET_BYTES) -> None:
        """For an engine that builds no DDP: the guard reduces the gradients at the end of every backward
        for which ``synchronises()`` (asked at the forward: accelerate's ``sync_gradients``) is true, as
        under a synchronising DDP. The rank-local ones when every trainable parameter is rank-local (DDP
        refuses a model with nothing for it to manage); ``everything`` (a model split over TP groups, whose
        DTensor parameters DDP cannot average) as :func:`~.gradients.reduce_gradients` does, in buckets of
        ``bucket_bytes``."""
        self._engine_sync, self._sync_everything = synchronises, bucket_bytes if everything else None

    def refuse_manual_sync(self, what: str) -> None:
        """``sync_gradients`` / ``GradientSync`` on a model that DDP already synchronises would reduce
        every gradient twice."""
        if self.under_ddp:
            raise ExpertParallelError(
                f"{what}: this model runs inside DistributedDataParallel (or an engine prepared by hp-rewrite), "
                "which (with hp-rewrite's expert reduction) already gives every gradient the unmodified model's "
                "value after backward(); "
                f"remove the {what} call"
            )


def install_engine_guard(model: nn.Module, ep: ExpertParallelGroup) -> EngineGuard | None:
    """Install the guard on a rewritten model (nothing to guard without expert-parallel holders)."""
    if not rank_local_modules(model):
        return None
    return EngineGuard(model, ep)
