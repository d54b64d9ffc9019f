"""transformers ``Trainer`` (and its subclasses, TRL's ``SFTTrainer`` among them) with an
expert-parallel model.

Training itself needs nothing: Trainer wraps the model in DDP through accelerate, and the model's
engine guard makes DDP and ``clip_grad_norm_`` exact (:mod:`hp_rewrite.sync.engines`). Saving and
resuming do, because Trainer writes from rank 0 alone and each rank holds different experts:

* ``save_model`` (also called for every checkpoint) becomes collective: the experts are gathered
  and rank 0 writes a standard checkpoint that unmodified transformers loads (checkpoints with the
  in-memory names, which Trainer's resume reads, see ``_save_model``);
* a checkpoint gets one small file per rank with the optimizer state of that rank's experts
  (``optimizer.pt``, written by rank 0, holds rank 0's); resuming puts each rank's back;
* resuming reads the full checkpoint's experts into each rank's rows (``load_state_dict`` on the
  rewritten model slices them, see :func:`hp_rewrite.loading.save.load_full_checkpoints`).

A PEFT model with adapters on the experts saves as PEFT saves: ``save_model`` and checkpoints write
the adapter plain PEFT writes (every rank joins the save, whose state dict gathers the expert
adapters, see :mod:`hp_rewrite.loading.adapters`), with each rank's adapter optimizer state beside it;
resuming reads the adapter back through PEFT's ``load_adapter``. When the expert adapters are the
only trainable parameters, DDP (which would have nothing to manage) is left out and the engine guard
reduces their gradients at each synchronising step.

With ``fsdp_config`` version 2 the Trainer is prepared for FSDP2 instead (:mod:`.trainer_fsdp`). With the
plan's ``cp_size`` or ``tp_size`` its data loaders give each context or TP group one batch (:mod:`.batches`);
a model split over TP groups trains without DDP, its gradients reduced by the engine guard
(:func:`.accelerator.train_split_without_ddp`).
DeepSpeed and FSDP1 are refused: they would shard the rank-local experts as if they were one tensor.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..loading.adapters import has_expert_adapters
from ..loading.record import record_of, rewritten_model
from ..loading.save import save_pretrained
from ..runtime.errors import ExpertParallelError
from ..sync.gradients import rank_local_parameters, trains_rank_local_only
from .accelerator import (
    deepspeed_refusal,
    leave_out_ddp,
    refuse_split_under_fsdp,
    refuse_unsupported,
    train_split_without_ddp,
)
from .batches import share_batches, share_engine_generations
from .rank_state import expert_layout, rank_and_world, read_rank_file, write_atomically
from .rewritten import peft_model_of
from .rl import install_rollout_replay, install_weight_sync
from .routing import prepare_trainer_routing
from .trainer_fsdp import prepare_fsdp2_trainer, save_beside_model

EXPERT_OPTIMIZER_FILE = "hp_rewrite_expert_optimizer-rank{rank}-of-{world}.pt"


def _inner_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


def _indexed(optimizer, params) -> dict[int, torch.nn.Parameter]:
    """Position in the optimizer's flat parameter order (the keys of its state dict) -> parameter."""
    wanted = {id(p) for p in params}
    flat = [p for group in _inner_optimizer(optimizer).param_groups for p in group["params"]]
    return {i: p for i, p in enumerate(flat) if id(p) in wanted}


def save_expert_optimizer_state(optimizer, model, directory: str | os.PathLike) -> Path:
    """Write this rank's expert-parameter optimizer state into ``directory`` (every rank calls it)."""
    rank, world = rank_and_world()
    inner = _inner_optimizer(optimizer)
    state = {
        i: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in inner.state[p].items()}
        for i, p in _indexed(optimizer, rank_local_parameters(model)).items() if p in inner.state
    }
    path = Path(directory) / EXPERT_OPTIMIZER_FILE.format(rank=rank, world=world)
    write_atomically({"format": 1, "world": world, "experts": expert_layout(model), "state": state}, path)
    return path


def load_expert_optimizer_state(optimizer, model, directory: str | os.PathLike) -> None:
    """Put back what :func:`save_expert_optimizer_state` wrote for this rank (same world and experts)."""
    rank, world = rank_and_world()
    path = Path(directory) / EXPERT_OPTIMIZER_FILE.format(rank=rank, world=world)
    saved = read_rank_file(path, model, f"resume from {directory}")
    inner = _inner_optimizer(optimizer)
    params = _indexed(optimizer, rank_local_parameters(model))
    for i, entry in saved["state"].items():
        p = params[int(i)]
        inner.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and v.dim() else v for k, v in entry.items()}


class ExpertParallelCallback(TrainerCallback):
    """Writes each rank's expert optimizer state with every checkpoint, and puts it back on resume."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.resume_from: str | None = None  # set by the prepared ``train``

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        checkpoint = self.resume_from
        if checkpoint is None or optimizer is None or not os.path.isfile(os.path.join(checkpoint, "optimizer.pt")):
            return  # a fresh start, or a model-only checkpoint: Trainer starts the optimizer afresh too
        load_expert_optimizer_state(optimizer, rewritten_model(self.trainer.model), checkpoint)

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        if args.save_only_model or optimizer is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        save_expert_optimizer_state(optimizer, rewritten_model(self.trainer.model), folder)


def _save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
    """Trainer.save_model on every rank: the experts are gathered, rank 0 writes.

    A checkpoint written during training (``_internal_call``) keeps the in-memory tensor names: Trainer
    resumes with ``load_state_dict(strict=False)``, which would skip the checkpoint format's per-expert
    keys without an error (plain transformers' own checkpoints of MoE models lose their experts on
    resume that way). ``save_model`` by the user writes what ``save_pretrained`` writes."""
    output_dir = output_dir if output_dir is not None else self.args.output_dir
    save_pretrained(self.model, output_dir, save_original_format=not _internal_call)
    save_beside_model(self, output_dir)


def _join_adapter_saves(trainer) -> None:
    """Trainer saves a PEFT model from the writing ranks only (``should_save``); gathering the expert
    adapters takes every rank, so the others join with a save that writes nothing."""
    save_model = trainer.save_model

    def save_model_on_every_rank(output_dir: str | None = None, _internal_call: bool = False):
        if not trainer.args.should_save:
            trainer.model.save_pretrained(output_dir if output_dir is not None else trainer.args.output_dir,
                                          is_main_process=False)
        return save_model(output_dir, _internal_call)

    trainer.save_model = save_model_on_every_rank


def _count_groups_once(trainer, size: int) -> None:
    """Trainer's total batch size (its logs, samples per second) counts every rank as data-parallel; a
    context or TP group of ``size`` ranks holds one batch."""
    if getattr(trainer, "hp_rewrite_cp_counted", False):
        return
    total = trainer.get_total_train_batch_size
    trainer.get_total_train_batch_size = lambda args: total(args) // size
    trainer.hp_rewrite_cp_counted = True


def prepare_trainer(trainer):
    """Make ``trainer`` save, checkpoint and resume its expert-parallel model exactly (module doc).

    Call it on every rank after creating the Trainer and before ``train()``. Returns the trainer.
    """
    model = rewritten_model(trainer.model)
    if model is None:
        raise ExpertParallelError(
            "prepare_trainer: the Trainer's model was not rewritten by hp-rewrite; load it with "
            "hp_rewrite.auto_patch / hp_rewrite.from_pretrained"
        )
    peft = peft_model_of(trainer.model, "prepare_trainer") is not None  # Trainer saves and resumes its adapter
    refuse_unsupported(trainer.accelerator, "prepare_trainer")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise deepspeed_refusal("prepare_trainer")
    ep = record_of(model).ep
    refuse_split_under_fsdp(trainer.accelerator, model, "prepare_trainer")
    share_batches(trainer.accelerator, ep.batch_ranks, "prepare_trainer")  # one batch per context or TP group
    if ep.batch_ranks > 1:
        share_engine_generations(trainer, ep.batch_group)  # and one set of vLLM completions
        _count_groups_once(trainer, ep.batch_ranks)
    if ep.tp_size > 1:  # DTensor slices: no DDP, the guard reduces them
        train_split_without_ddp(trainer.accelerator, model, "prepare_trainer")
        trainer._mixed_mesh_grads = False  # its clip through the accelerator's (each slice once), not its own
    prepare_trainer_routing(trainer)  # every engine below: counts reduced each step, logged as moe/...
    install_weight_sync(trainer)  # TRL's vLLM paths send the checkpoint's names and full tensors
    install_rollout_replay(trainer)  # routing.replay_rollout: the training forwards replay vLLM's routes
    if getattr(trainer, "is_fsdp_enabled", False):
        return prepare_fsdp2_trainer(trainer, _save_model, peft)
    if peft and (record_of(model).ep.size == 1 or not has_expert_adapters(model)):
        return trainer  # adapters on replicated weights only: Trainer's own saving is exact
    if getattr(trainer, "hp_rewrite_callback", None) is not None:
        return trainer
    callback = ExpertParallelCallback(trainer)
    trainer.add_callback(callback)
    trainer.hp_rewrite_callback = callback
    if peft:
        _join_adapter_saves(trainer)
    else:
        trainer.save_model = types.MethodType(_save_model, trainer)
    if trainer.args.world_size > 1 and ep.tp_size == 1 and trains_rank_local_only(model, trainer.model):
        leave_out_ddp(trainer.accelerator, model)
    train = trainer.train

    def train_resumable(resume_from_checkpoint=None, *args, **kwargs):
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            from ..hf import last_checkpoint

            checkpoint = last_checkpoint(trainer.args.output_dir)
        callback.resume_from = checkpoint or None
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_resumable
    return trainer
