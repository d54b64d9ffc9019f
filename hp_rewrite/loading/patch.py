"""Load-time integration: every ``from_pretrained`` of a transformers MoE model returns it rewritten.

``auto_patch(plan)`` wraps ``PreTrainedModel.from_pretrained`` (which every concrete class and every
Auto class ends in) until ``remove()`` or the end of a ``with`` block; ``from_pretrained(model_dir,
plan=...)`` does the same for one call. transformers resolves the call as it would for the unmodified
model (class, dtype, attention, files); the weights are read by :mod:`hp_rewrite.loading.pretrained`,
only this rank's experts among them (a checkpoint it cannot read that way is loaded whole and sharded
after, with a warning).
The EP group is built from the plan over the ``torch.distributed`` world, which a parallel plan
starts under torchrun when nothing has yet (:mod:`.world`); with no launcher a parallel plan is
refused unless ``single_process=True`` asks for the model whole in one process (EP=1, through the same
generated code).
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..hf import pretrained_class_for, pretrained_model_class, transformers_logger
from ..plan import Plan, load_plan
from ..runtime import installed
from ..runtime.binding.install import exchange_runtimes
from ..runtime.errors import ExpertParallelError
from ..runtime.group.groups import ExpertParallelGroup, build_expert_parallel_group
from ..runtime.routing.aux_loss import install_router_losses
from ..runtime.routing.replay import install_replay
from ..runtime.routing.routing_load import freeze_routers, install_routing_loads
from ..sync.engines import install_engine_guard
from ..sync.generation import install_lockstep_generation
from .rank0 import rank0_first
from .record import RewriteInfo, record_here, set_record
from .world import ensure_world

PLAN_ENV = "HP_REWRITE_PLAN"
DEFAULT_ARTIFACT_DIR = Path.home() / ".cache" / "hp-rewrite"


def resolve_plan(plan: str | os.PathLike | Plan | None) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if plan is None:
        plan = os.environ.get(PLAN_ENV)
        if not plan:
            raise ExpertParallelError(f"no plan given: pass auto_patch(plan) or set {PLAN_ENV} to a plan file")
    return load_plan(plan)


def expert_parallel_group_for(plan: Plan, mesh: DeviceMesh | None = None,
                              single_process: bool = False) -> ExpertParallelGroup:
    """The plan's EP group over the world (from ``mesh``, whose ``ep`` dimension must equal the plan's
    ``ep_size``, or from a mesh built for the plan), started here under a launcher that has not yet
    (:func:`~.world.ensure_world`); EP=1 for a plan of one rank, or with ``single_process=True``."""
    if single_process and mesh is not None:
        raise ExpertParallelError("single_process=True loads the model whole in this process: pass no mesh")
    if not ensure_world(plan, single_process):
        if mesh is not None:
            raise ExpertParallelError("a device mesh needs torch.distributed initialised (launch with torchrun)")
        return ExpertParallelGroup.single()
    return build_expert_parallel_group(plan.ep_size, timeout_s=plan.runtime.timeout_s, mesh=mesh,
                                       tp_size=plan.tp_size, cp_size=plan.cp_size)


def rewrite_model(model: nn.Module, plan: Plan, ep: ExpertParallelGroup | None = None,
                  artifact_dir: Path | None = None, mesh: DeviceMesh | None = None,
                  single_process: bool = False) -> nn.Module:
    """Make a loaded model expert-parallel in place (generate on rank 0, install everywhere).
    ``single_process``: as :func:`from_pretrained`'s."""
    from ..match.generate import ensure_artifact
    from .install import install

    if record_here(model) is not None:
        return model
    refuse_wrapped(model)
    ep = ep or expert_parallel_group_for(plan, mesh, single_process)
    out = Path(artifact_dir or plan.output.dir or DEFAULT_ARTIFACT_DIR)
    artifact = rank0_first(lambda: ensure_artifact(model, plan, model.config, out))
    patched = install(model, artifact, plan, ep, shard=True)
    return attach(model, RewriteInfo(plan, ep, artifact.directory, patched))


def refuse_wrapped(model: nn.Module) -> None:
    """Rewrite the model, then wrap it: a DDP or FSDP built first holds the replaced expert weights."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for m in model.modules():
        if isinstance(m, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)):
            raise ExpertParallelError(
                f"{type(m).__name__} wraps the model (or part of it) before the rewrite: rewrite first "
                "(auto_patch / from_pretrained / rewrite_model on the unwrapped model), then wrap the result"
            )


def attach(model: nn.Module, info: RewriteInfo) -> nn.Module:
    """Mark a rewritten model: ``model.hp_rewrite``, the engine guard (sync.engines) and a
    save_pretrained that gathers the experts."""
    from .adapters import install_adapter_state_hooks
    from .save import load_full_checkpoints

    if info.plan.tp_size > 1:
        info.tensor = split_dense(model, info.plan, info.ep, info.patched)
    if info.plan.cp_size > 1:
        info.context = split_context(model, info.plan, info.ep)
    routing = info.plan.routing
    if routing.freeze_router:  # before any engine or optimizer sees the router parameters
        freeze_routers(model)
    info.engine = install_engine_guard(model, info.ep)
    install_lockstep_generation(model, info.ep.size > 1 or info.ep.tp_size > 1 or info.ep.cp_size > 1,
                                info.ep.batch_group)
    info.runtime = next(iter(exchange_runtimes(model)), None)
    install_replay(model, routing.replay_in_recompute)
    if routing.aux_loss == "global" or routing.z_loss_coef:
        install_router_losses(model, balance_globally=routing.aux_loss == "global", z_coef=routing.z_loss_coef,
                              tp_size=info.plan.tp_size)
    if routing.stats or routing.bias_update_rate:
        info.routing = install_routing_loads(model, log=routing.stats, bias_update_rate=routing.bias_update_rate)
    load_full_checkpoints(model)
    install_adapter_state_hooks(model)
    set_record(model, info)
    info.summary = load_summary(model, info)
    log_load(info.summary)
    # the model's own save_pretrained would write only this rank's experts: gather them instead
    info.original_save_pretrained = model.save_pretrained
    model.save_pretrained = types.MethodType(_save_pretrained, model)
    if info.ep.size > 1 or info.ep.tp_size > 1:  # the experts are split: refuse TRL's own vLLM weight sync
        model.named_modules = types.MethodType(named_modules, model)
    return model


# TRL's VLLMGeneration walks the model in these to send vLLM its weights (prepare_trainer replaces them)
_TRL_WEIGHT_WALKS = frozenset({"_iter_named_params", "_iter_fsdp_params", "_iter_fsdp1_params", "_iter_fsdp2_params"})


def named_modules(self: nn.Module, *args, **kwargs):
    """``nn.Module.named_modules`` (which ``named_parameters`` and ``parameters`` walk, inside PEFT's wrapper
    too), refused when TRL's own vLLM weight sync walks the model: a trainer not passed to
    ``prepare_trainer`` would send vLLM each rank's slice of the experts under the full tensors' names."""
    frame = sys._getframe(1)
    for _ in range(12):  # TRL's walk is a few generator frames up (PEFT's and FSDP2's wrappers between)
        if frame is None:
            break
        code = frame.f_code
        if code.co_name in _TRL_WEIGHT_WALKS and Path(code.co_filename).name == "vllm_generation.py":
            raise ExpertParallelError(
                "TRL's vLLM weight sync is reading an expert-parallel model whose trainer was not passed to "
                "hp_rewrite.prepare_trainer: it would send vLLM each rank's slice of the experts under the full "
                "tensors' names. Call hp_rewrite.prepare_trainer(trainer) on every rank after building the trainer "
                "and before train(); it sends what save_pretrained writes instead")
        frame = frame.f_back
    return type(self).named_modules(self, *args, **kwargs)


def load_summary(model: nn.Module, info: RewriteInfo) -> str:
    """One line on what this rank holds: the blocks made expert-parallel, the EP size and this rank's
    experts, TP / SP, the plan's hash."""
    held = {f"{b.placement.num_local} of {b.placement.num_experts}" for m in model.modules()
            if (b := installed.binding(m)) is not None}
    experts = ", ".join(sorted(held)) or "none"
    tp = f"TP {info.plan.tp_size}" + (" with sequence parallelism" if info.plan.sequence_parallel else "")
    cp = f", CP {info.plan.cp_size} ({info.plan.context.scheme})" if info.plan.cp_size > 1 else ""
    return (f"hp-rewrite: {len(info.patched)} MoE block(s) expert-parallel, EP {info.ep.size} "
            f"(rank {info.ep.rank} of its EP group holds {experts} experts per block), {tp}{cp}, "
            f"plan {info.plan.hash()[:12]}")


def log_load(summary: str) -> None:
    """The load summary through transformers' logger: INFO on global rank 0, DEBUG on the others."""
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    logger = transformers_logger("hp_rewrite")
    (logger.info if first else logger.debug)(summary)


def tensor_layout(model: nn.Module, plan: Plan, selected) -> object:
    """The TP layout (:func:`hp_rewrite.tensor.plan_layout`) of ``model``'s dense parts around the MoE
    blocks ``selected(structure)`` keeps; a :class:`~hp_rewrite.tensor.TensorParallelError` when it
    cannot be split."""
    from ..match import find_blocks
    from ..tensor import MoeBlockSpec, plan_layout

    blocks = [MoeBlockSpec(s.path, s.experts_name, s.shared_name) for s in find_blocks(model) if selected(s)]
    return plan_layout(model, blocks, plan.tp_size)


def split_context(model: nn.Module, plan: Plan, ep: ExpertParallelGroup):
    """The sequence split over the EP group's context group (:mod:`hp_rewrite.context`)."""
    from ..context import install_context

    if ep.cp_size != plan.cp_size:
        raise ExpertParallelError(
            f"the plan's cp_size is {plan.cp_size} but the EP group's context group has {ep.cp_size} rank(s): "
            "build it with build_expert_parallel_group(ep_size, cp_size=...), or leave ep to hp-rewrite")
    return install_context(model, ep.cp_group, ep.cp_rank, ep.cp_size, ep.tp_size,
                           local_logits=plan.context.logits == "local")


def split_dense(model: nn.Module, plan: Plan, ep: ExpertParallelGroup, patched: list[str]):
    """Tensor (and sequence) parallelism of the dense parts over the EP group's TP group."""
    from ..tensor import parallelize

    if ep.tp_size != plan.tp_size:
        raise ExpertParallelError(
            f"the plan's tp_size is {plan.tp_size} but the EP group's TP group has {ep.tp_size} rank(s): build it "
            "with build_expert_parallel_group(ep_size, tp_size=...), or leave ep to hp-rewrite"
        )
    layout = tensor_layout(model, plan, lambda s: s.path in patched)
    parallelize(model, layout, ep.tp_mesh["tp"], plan.sequence_parallel)
    return layout


def load_pretrained(call, plan: Plan, artifact_dir: Path | None = None, mesh: DeviceMesh | None = None,
                    keep_quantized: bool = False, single_process: bool = False):
    """``call()`` (a transformers ``from_pretrained``) with only this rank's experts read, its result
    rewritten (see :mod:`hp_rewrite.loading.pretrained`)."""
    from .pretrained import load_rewritten

    ep = expert_parallel_group_for(plan, mesh, single_process)
    out = Path(artifact_dir or plan.output.dir or DEFAULT_ARTIFACT_DIR)
    return load_rewritten(
        call, plan, ep, out,
        rewrite=lambda model: rewrite_model(model, plan, ep=ep, artifact_dir=out),
        attach=lambda model, loading: attach(model, RewriteInfo(plan, ep, out, loading.patched, loading.report())),
        keep_quantized=keep_quantized,
    )


# save_pretrained's arguments that change nothing in what an expert-parallel save writes: every rank
# calls it and global rank 0 writes (is_main_process, and accelerate's save_function, which transformers 5
# ignores too), safetensors is written either way (as transformers)
_SAVE_ACCEPTED = {"is_main_process", "safe_serialization", "state_dict", "save_function"}
_SAVE_HONOURED = {"max_shard_size", "save_original_format"}
# the rest of transformers' signature, refused unless left at its default
_SAVE_DEFAULTS = {"push_to_hub": False, "variant": None, "token": None, "save_peft_format": True,
                  "distributed_checkpoint": False}


def _save_pretrained(self: nn.Module, save_directory, *args, **kwargs):
    """Gather the experts and write what transformers writes (see :mod:`hp_rewrite.loading.save`).

    Collective: every rank calls it (transformers ``Trainer`` calls it on rank 0 only: use
    ``hp_rewrite.prepare_trainer(trainer)``)."""
    from .save import save_pretrained

    caller = sys._getframe(1).f_code
    if caller.co_name == "_save" and Path(caller.co_filename).name == "trainer.py":
        raise ExpertParallelError(
            "transformers Trainer saves the model from rank 0 alone, and the other ranks hold experts it "
            "needs: call hp_rewrite.prepare_trainer(trainer) on every rank before train(), which makes "
            "save_model and checkpoints gather the experts"
        )
    if args:
        raise ExpertParallelError("save_pretrained of an expert-parallel model: pass its options by name "
                                  f"(got {len(args)} positional argument(s) after the directory)")
    refused = sorted(k for k in kwargs if k not in _SAVE_ACCEPTED | _SAVE_HONOURED
                     and not (k in _SAVE_DEFAULTS and kwargs[k] == _SAVE_DEFAULTS[k]))
    if refused:
        raise ExpertParallelError(
            f"save_pretrained of an expert-parallel model: {', '.join(refused)} cannot be honoured (the experts "
            "are gathered from every rank into safetensors files in a local directory); save without it, "
            "then upload or convert the directory"
        )
    state_dict = kwargs.get("state_dict")
    if state_dict is not None:
        own = {id(t) for t in self.state_dict(keep_vars=True).values()} | {
            t.data_ptr() for t in self.state_dict().values()}
        if any(id(t) not in own and t.data_ptr() not in own for t in state_dict.values()):
            raise ExpertParallelError(
                "save_pretrained(state_dict=...) of an expert-parallel model: the state dict holds tensors "
                "that are not the model's own; the experts are gathered from the model itself"
            )
    return save_pretrained(self, save_directory, **{k: kwargs[k] for k in _SAVE_HONOURED if k in kwargs})


class AutoPatch:
    """Handle of an installed auto-patch; also a context manager that removes it on exit."""

    def __init__(self, plan: Plan, artifact_dir: Path | None = None, mesh: DeviceMesh | None = None,
                 single_process: bool = False) -> None:
        self.plan, self.artifact_dir, self.mesh, self.single_process = plan, artifact_dir, mesh, single_process
        self._owner = pretrained_model_class()  # every model class's from_pretrained ends in its
        self._original = self._owner.__dict__["from_pretrained"]
        original_fn = self._original.__func__
        patch = self

        def from_pretrained(cls, *args, **kwargs):
            from .pretrained import dequantize_at_load

            name = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            kwargs, keep = dequantize_at_load(name, kwargs)
            return load_pretrained(lambda: original_fn(cls, *args, **kwargs), patch.plan, patch.artifact_dir,
                                   patch.mesh, keep, patch.single_process)

        from_pretrained.__doc__ = original_fn.__doc__
        from_pretrained.hp_auto_patch = self
        self._patched = classmethod(from_pretrained)
        self.active = False

    def install(self) -> AutoPatch:
        current = self._owner.__dict__["from_pretrained"]
        if getattr(current.__func__, "hp_auto_patch", None) is not None:
            raise RuntimeError("hp-rewrite auto-patch is already installed; remove() it first")
        self._owner.from_pretrained = self._patched
        self.active = True
        return self

    def remove(self) -> None:
        if self.active:
            self._owner.from_pretrained = self._original
            self.active = False

    def __enter__(self) -> AutoPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def auto_patch(plan: str | os.PathLike | Plan | None = None, artifact_dir: Path | None = None,
               mesh: DeviceMesh | None = None, single_process: bool = False) -> AutoPatch:
    """Install the patch now (global) and return its handle; ``with auto_patch(p):`` scopes it.

    With no plan, the path is read from the ``HP_REWRITE_PLAN`` environment variable (at this call,
    never at import time). ``mesh``: the user's device mesh, ``("efsdp", "ep")`` or
    ``("dp_replicate", "efsdp", "ep")``, whose ``ep`` dimension gives the EP groups. ``single_process``:
    as :func:`from_pretrained`'s.
    """
    return AutoPatch(resolve_plan(plan), artifact_dir, mesh, single_process).install()


def from_pretrained(model_dir: str | os.PathLike, plan: str | os.PathLike | Plan | None = None,
                    artifact_dir: Path | None = None, mesh: DeviceMesh | None = None, single_process: bool = False,
                    **kwargs) -> nn.Module:
    """``from_pretrained`` of the class an Auto class picks for the checkpoint (``kwargs`` as transformers
    takes them), returned rewritten: one call, no global patch left behind.

    Under torchrun a parallel plan starts the process group if nothing has yet (the device's backend, its
    default timeout), so ``TrainingArguments`` and the other engines built after use it; with no launcher it
    is refused. ``single_process=True`` asks for the model whole in this process instead, not
    expert-parallel (for inspection or a notebook; a warning says so)."""
    from .pretrained import dequantize_at_load

    plan = resolve_plan(plan)
    kwargs, keep = dequantize_at_load(model_dir, kwargs)
    cls = pretrained_class_for(model_dir, **kwargs)
    return load_pretrained(lambda: cls.from_pretrained(model_dir, **kwargs), plan, artifact_dir, mesh, keep,
                           single_process)
