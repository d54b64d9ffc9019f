"""transformers ``Trainer`` (TRL's trainers too) with ``fsdp_config`` version 2 and an expert-parallel model.

Trainer's FSDP2 goes through accelerate (prepared by :func:`~.accelerator.prepare_accelerator`: the
experts sharded over the expert-replica mesh first, the rest by ``fsdp_config``). On top, the Trainer
object gets:

* its gradient norm from :func:`hp_rewrite.clip_grad_norm_` (Trainer's own per-mesh norm counts only
  this EP rank's experts);
* ``save_model``: the full model gathered, written by rank 0 as ``save_pretrained`` writes it (also
  with ``SHARDED_STATE_DICT``, where Trainer writes nothing); in checkpoints only with
  ``FULL_STATE_DICT``, as Trainer;
* checkpoints and resume through one ``torch.distributed.checkpoint`` of model and optimizer with
  global expert tensors (``hp_rewrite_fsdp/`` in each checkpoint folder), whatever ``state_dict_type``
  says: accelerate's would keep one EP rank's experts (``FULL``) or write every EP rank's under the
  same names (``SHARDED``). The scheduler, scaler, RNG and trainer state are Trainer's own files.

A PEFT model saves what trains, as Trainer saves a PEFT model: ``save_model`` and every checkpoint
write the adapter as PEFT writes it (every rank joins the save: its state dict gathers the adapters,
see :mod:`hp_rewrite.loading.adapters`), whatever ``state_dict_type`` says (Trainer's FSDP2 would
gather the whole frozen base for it, or write nothing); a checkpoint adds each rank's optimizer state
(:mod:`.rank_state`) and resuming reads the adapter back with PEFT's ``load_adapter``.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import torch

from ..runtime.errors import ExpertParallelError
from .accelerator import prepare_accelerator
from .checkpoint import load_checkpoint, save_checkpoint
from .fsdp import clip_grad_norm_
from .rank_state import load_active_adapter, load_optimizer, rank_and_world, save_optimizer
from .rewritten import refuse_unsaved_trainables

#: the checkpoint folder's model-and-optimizer state
FSDP_FOLDER = "hp_rewrite_fsdp"
SCHEDULER_FILE = "scheduler.pt"  # Trainer's SCHEDULER_NAME
#: a PEFT model's checkpoint: each rank's optimizer state (adapters only), beside the adapter
ADAPTER_OPTIMIZER_FILE = "hp_rewrite_optimizer-rank{rank}-of-{world}.pt"


def _is_sharded(trainer) -> bool:
    return "SHARDED" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)


def _inner_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
    save_checkpoint(self.model, _inner_optimizer(self.optimizer), Path(output_dir) / FSDP_FOLDER)
    _save_scheduler(self, output_dir)


def _folder(checkpoint: str) -> Path:
    folder = Path(checkpoint) / FSDP_FOLDER
    if not folder.is_dir():
        raise ExpertParallelError(
            f"resume from {checkpoint}: no {FSDP_FOLDER}/ (the expert-parallel model and optimizer state). Resume "
            "from a checkpoint written by a Trainer passed to hp_rewrite.prepare_trainer, with save_only_model=False"
        )
    return folder


def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
    load_checkpoint(self.model, None, _folder(resume_from_checkpoint))


def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    load_checkpoint(self.model, _inner_optimizer(self.optimizer), _folder(checkpoint), model_weights=False)
    _load_scheduler(self, checkpoint)


def _save_scheduler(self, output_dir: str) -> None:
    if self.args.should_save and self.lr_scheduler is not None:
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))


def _load_scheduler(self, checkpoint: str) -> None:
    scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
    if self.lr_scheduler is not None and os.path.isfile(scheduler):
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _adapter_optimizer_file(output_dir: str) -> Path:
    rank, world = rank_and_world()
    return Path(output_dir) / ADAPTER_OPTIMIZER_FILE.format(rank=rank, world=world)


def _save_adapter(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
    """Trainer.save_model of a PEFT model on every rank: the adapter gathered, written by the saving rank."""
    output_dir = output_dir if output_dir is not None else self.args.output_dir
    os.makedirs(output_dir, exist_ok=True)
    self.model.save_pretrained(output_dir, is_main_process=self.args.should_save)
    save_beside_model(self, output_dir)


def save_beside_model(trainer, output_dir: str) -> None:
    """What Trainer.save_model writes beside the model from the saving rank: the processing class
    (tokenizer...) and the training arguments."""
    if trainer.args.should_save:
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))


def _save_adapter_optimizer_and_scheduler(self, output_dir: str) -> None:
    save_optimizer(_inner_optimizer(self.optimizer), self.model, _adapter_optimizer_file(output_dir))
    _save_scheduler(self, output_dir)


def _load_adapter_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
    load_active_adapter(self.model, resume_from_checkpoint, f"resume from {resume_from_checkpoint}")


def _load_adapter_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    load_optimizer(_inner_optimizer(self.optimizer), self.model, _adapter_optimizer_file(checkpoint),
                   f"resume from {checkpoint}")
    _load_scheduler(self, checkpoint)


def _load_best_model(self) -> None:
    raise ExpertParallelError(
        "prepare_trainer: load_best_model_at_end with fsdp_config is not supported for an expert-parallel model; "
        "train without it and load the best checkpoint's hp_rewrite_fsdp/ with hp_rewrite.load_checkpoint"
    )


def prepare_fsdp2_trainer(trainer, save_model_gathered, peft: bool):
    """The FSDP2 part of :func:`hp_rewrite.prepare_trainer` (module doc); ``save_model_gathered`` is its
    ``Trainer.save_model`` (every rank gathers, rank 0 writes); ``peft``: the model is a PEFT model."""
    if getattr(trainer, "hp_rewrite_fsdp", False):
        return trainer
    if trainer.args.load_best_model_at_end:  # refused before training, not at its end
        _load_best_model(trainer)
    if peft and trainer.args.save_strategy != "no":  # its checkpoints hold the adapter only
        refuse_unsaved_trainables(trainer.model, "prepare_trainer")
    prepare_accelerator(trainer.accelerator)
    trainer._has_mixed_mesh_grads = lambda model: True  # Trainer then asks _mixed_mesh_grad_norm
    trainer._mixed_mesh_grad_norm = lambda model, max_norm: clip_grad_norm_(model.parameters(), max_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if _internal_call and _is_sharded(self):
            return  # a SHARDED_STATE_DICT checkpoint holds its model in FSDP_FOLDER only, as Trainer's does
        save_model_gathered(self, output_dir, _internal_call)

    methods = {"save_model": save_model, "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
               "_load_from_checkpoint": _load_from_checkpoint,
               "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler}
    if peft:
        methods = {"save_model": _save_adapter, "_save_optimizer_and_scheduler": _save_adapter_optimizer_and_scheduler,
                   "_load_from_checkpoint": _load_adapter_from_checkpoint,
                   "_load_optimizer_and_scheduler": _load_adapter_optimizer_and_scheduler}
    for name, method in methods.items():
        setattr(trainer, name, types.MethodType(method, trainer))
    trainer._load_best_model = types.MethodType(_load_best_model, trainer)
    trainer.hp_rewrite_fsdp = True
    return trainer
