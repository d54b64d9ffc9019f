"""Routing statistics and control in training, and the engines' hooks that drive them.

The counts are taken in the forward (:mod:`hp_rewrite.runtime.routing.routing_load`); after every optimizer
step they are reduced over the world and the routers' selection biases move
(``routing.bias_update_rate``). Here they also become statistics (:class:`RoutingStats`): per MoE
layer the tokens each expert was chosen for over the global batch (every rank, every micro-batch),
its imbalance (max / mean load), experts that received nothing, slots dropped for capacity, exchange
bytes. A prepared Trainer (TRL's trainers included) and a prepared Accelerator step the counts and
add ``moe/`` keys to their next log, so they reach ``log_history`` and every ``report_to`` tracker; a
hand-written loop calls :func:`track_routing` once and :func:`routing_stats` where it logs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..loading.record import info_of, record_of, rewritten_model
from ..runtime import installed
from ..runtime.errors import ExpertParallelError
from ..runtime.routing.aux_loss import is_wrapped, wrap_forward
from ..runtime.routing.routing_load import LayerCounts, ModelRouting, router_parameters

#: beside a prepared Trainer's checkpoints (its ``output_dir``) or in an Accelerator's ``project_dir``
ROUTING_LOG = "hp_rewrite_routing.jsonl"


@dataclass(frozen=True)
class RoutingStats:
    """The global routing counts of the steps since the last read, per MoE layer."""

    steps: int
    layers: tuple[LayerCounts, ...]

    @staticmethod
    def imbalance(layer: LayerCounts) -> float:
        """Max over mean load of the layer's experts (1 is perfectly even; 0 when nothing was routed)."""
        total = sum(layer.tokens_per_expert)
        return max(layer.tokens_per_expert) * len(layer.tokens_per_expert) / total if total else 0.0

    @staticmethod
    def rank_imbalance(layer: LayerCounts, balanced: bool = False) -> float:
        """Max over mean rows of the EP group's ranks as the experts are placed (what the step waits for
        without ``runtime.balance``), or, ``balanced``, where they were computed (1 is even; 0: no rows)."""
        rows = layer.rank_rows_balanced if balanced else layer.rank_rows
        total = sum(rows)
        return max(rows) * len(rows) / total if total else 0.0

    @staticmethod
    def dead_experts(layer: LayerCounts) -> int:
        return sum(1 for n in layer.tokens_per_expert if n == 0)

    @property
    def dropped_fraction(self) -> float:
        chosen = sum(sum(layer.tokens_per_expert) for layer in self.layers)
        return sum(sum(layer.dropped_per_expert) for layer in self.layers) / chosen if chosen else 0.0

    def logs(self, prefix: str = "moe/") -> dict[str, float]:
        """What the engines log: the worst layer's expert imbalance and rank imbalance (before and after
        ``runtime.balance``), dead experts summed over layers, the dropped fraction, the exchange bytes per
        step (all ranks), and each layer's imbalances."""
        if not self.layers:
            return {}
        out = {
            f"{prefix}imbalance": max(self.imbalance(layer) for layer in self.layers),
            f"{prefix}rank_imbalance": max(self.rank_imbalance(layer) for layer in self.layers),
            f"{prefix}rank_imbalance_balanced": max(self.rank_imbalance(layer, True) for layer in self.layers),
            f"{prefix}dead_experts": float(sum(self.dead_experts(layer) for layer in self.layers)),
            f"{prefix}dropped_fraction": self.dropped_fraction,
            f"{prefix}exchange_bytes_per_step": sum(layer.bytes_sent for layer in self.layers) / max(self.steps, 1),
        }
        for layer in self.layers:
            out[f"{prefix}layer_{layer.index}/imbalance"] = self.imbalance(layer)
            out[f"{prefix}layer_{layer.index}/rank_imbalance"] = self.rank_imbalance(layer)
            out[f"{prefix}layer_{layer.index}/rank_imbalance_balanced"] = self.rank_imbalance(layer, True)
        return out

    def as_dict(self) -> dict:
        """JSON-ready: every layer's counts (what ``hp-rewrite profile --routing-log`` draws)."""
        return {"steps": self.steps, "layers": [
            {"name": layer.name, "index": layer.index, "block": layer.block,
             "tokens_per_expert": list(layer.tokens_per_expert),
             "dropped_per_expert": list(layer.dropped_per_expert), "rank_rows": list(layer.rank_rows),
             "rank_rows_balanced": list(layer.rank_rows_balanced), "bytes_sent": layer.bytes_sent,
             "tokens": layer.tokens}
            for layer in self.layers]}


def _routing_of(model: nn.Module, what: str) -> ModelRouting:
    routing = info_of(model, what).routing
    if routing is None:
        raise ExpertParallelError(f"{what}: the plan turns routing statistics off (routing.stats: false)")
    return routing


def routing_stats(model: nn.Module) -> RoutingStats:
    """The routing statistics since the last read (then they start again). Every rank calls it: the
    counts not reduced by a step yet are reduced here (one all-reduce)."""
    routing = _routing_of(model, "routing_stats")
    if not routing.log:
        raise ExpertParallelError("routing_stats: the plan turns routing statistics off (routing.stats: false)")
    routing.reduce()
    return RoutingStats(*_read(routing))


def _read(routing: ModelRouting) -> tuple[int, tuple[LayerCounts, ...]]:
    steps, layers = routing.read()
    return steps, tuple(layers)


def track_routing(model: nn.Module, optimizer):
    """After every ``optimizer.step()`` (a step post hook on ``optimizer``, or on the optimizer an
    accelerate ``AcceleratedOptimizer`` wraps): the step's routing counts reduced over the world, the
    selection biases updated (``routing.bias_update_rate``). Call it once, on every rank, before
    training; returns the hook's handle."""
    routing = _routing_of(model, "track_routing")
    if routing.tracked:
        raise ExpertParallelError("track_routing: this model's routing is stepped already (an earlier track_routing, "
                                  "a prepared Trainer or Accelerator): one step hook per model")
    inner = getattr(optimizer, "optimizer", optimizer)
    handle = inner.register_step_post_hook(lambda *_: routing.step())
    routing.tracked = True
    return handle


def refuse_trainable_routers(model: nn.Module, what: str) -> None:
    """``routing.freeze_router``: a router parameter that trains anyway (an adapter on the router, PEFT's
    ``modules_to_save``, ``requires_grad_(True)`` after loading) is refused by name."""
    inner = rewritten_model(model)
    if not record_of(inner).plan.routing.freeze_router:
        return
    training = [n for n, p in router_parameters(model).items() if p.requires_grad]
    if training:
        raise ExpertParallelError(
            f"{what}: routing.freeze_router is set, but router parameters train: {', '.join(training[:4])}"
            f"{' ...' if len(training) > 4 else ''}; take the routers out of the adapter's targets "
            "(target_modules, modules_to_save) or drop routing.freeze_router"
        )


def _take(routing: ModelRouting) -> RoutingStats | None:
    """The statistics of the steps reduced since the last read; None when no step was (a second log in
    the same step, an evaluation). Local: nothing collective, so one rank alone may log."""
    if routing.steps == 0:
        return None
    return RoutingStats(*_read(routing))


def _append(path: Path, step: int, stats: RoutingStats) -> None:
    """One JSON line per log with every layer's counts (what ``hp-rewrite profile --routing-log`` draws)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, **stats.as_dict()}) + "\n")


def _z_fold(trainer, z_coef: float) -> float | None:
    """The z-loss's weight inside ``aux_loss`` for a trainer that computes its own loss and adds only
    ``router_aux_loss_coef * aux_loss`` from the model (TRL's SFTTrainer); None for Trainer's own loss."""
    from transformers import Trainer

    if type(trainer).compute_loss is Trainer.compute_loss:
        return None
    name = type(trainer).__name__
    if not getattr(trainer, "aux_loss_enabled", False) or not getattr(trainer, "router_aux_loss_coef", 0.0):
        raise ExpertParallelError(
            f"prepare_trainer: routing.z_loss_coef: {name} computes its own loss and takes from the model only its "
            "load-balancing term (aux_loss times router_aux_loss_coef), which is off here, so the z-loss would "
            "train nothing; turn the load-balancing loss on (router_aux_loss_coef) or set routing.z_loss_coef: 0"
        )
    return z_coef / trainer.router_aux_loss_coef  # TRL adds router_aux_loss_coef * aux_loss


def _trainer_aux_scale(trainer) -> float:
    """The factor for the global load-balancing term in the model's ``loss`` under ``trainer``: Trainer
    multiplies a loss normalised by its token count by the data-parallel ranks and does not divide it by the
    accumulation steps (transformers' own per-rank term is then weighted ranks x steps too much); the term
    must come out as its ranks' mean, averaged over the accumulation steps, as in a loop with DDP."""
    args = trainer.args
    kwargs_loss = bool(getattr(trainer, "model_accepts_loss_kwargs", False) or trainer.compute_loss_func is not None)
    scaled_for_ga = getattr(trainer, "loss_is_scaled_for_ga", None)
    scaled_for_ga = kwargs_loss if scaled_for_ga is None else scaled_for_ga
    ranks = trainer.accelerator.num_processes // max(1, getattr(trainer, "get_tp_size", lambda: 1)())
    summed = ranks if args.average_tokens_across_devices and kwargs_loss else 1
    return 1.0 / (summed * (args.gradient_accumulation_steps if scaled_for_ga else 1))


def prepare_trainer_routing(trainer) -> None:
    """Reduce the routing counts after every optimizer step and add them to the trainer's next log."""
    from transformers import TrainerCallback

    refuse_trainable_routers(trainer.model, "prepare_trainer")
    inner = rewritten_model(trainer.model)
    losses = installed.router_losses(inner)
    if losses is not None:
        losses.loss_scale = _trainer_aux_scale(trainer)
        if losses.z_coef:
            losses.aux_fold = _z_fold(trainer, losses.z_coef)
        if not is_wrapped(inner):  # the trainer replaced the forward (TRL's fused LM head): wrap it again
            wrap_forward(inner)
    routing = info_of(trainer.model, "prepare_trainer").routing
    if routing is None or getattr(trainer, "hp_routing", None) is not None:
        return

    class _RoutingStep(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            routing.step()

    trainer.add_callback(_RoutingStep())
    routing.tracked = True
    vars(trainer.accelerator).setdefault("hp_routing_by_trainer", []).append(routing)  # not stepped twice
    trainer.hp_routing = routing
    if not routing.log:
        return
    log = trainer.log

    def log_with_routing(logs, *args, **kwargs):
        if any(k.startswith("eval_") for k in logs):  # an evaluation's log: the statistics wait for training's
            return log(logs, *args, **kwargs)
        stats = _take(routing)
        if stats is None:
            return log(logs, *args, **kwargs)
        if trainer.is_world_process_zero():
            _append(Path(trainer.args.output_dir) / ROUTING_LOG, trainer.state.global_step, stats)
        return log({**logs, **stats.logs()}, *args, **kwargs)

    trainer.log = log_with_routing


def prepare_accelerator_routing(accelerator, prepared) -> None:
    """After ``accelerator.prepare`` returned ``prepared``: each expert-parallel model's routing counts
    are reduced after every step of the optimizers prepared with it or after it, and their statistics
    added to the next ``accelerator.log`` (every rank may call it: nothing collective happens there)."""
    prepared = prepared if isinstance(prepared, (tuple, list)) else (prepared,)
    known = vars(accelerator).setdefault("hp_routing", [])
    by_trainer = vars(accelerator).get("hp_routing_by_trainer", [])  # a prepared Trainer steps and logs them
    for m in prepared:
        if isinstance(m, nn.Module) and rewritten_model(m) is not None:
            refuse_trainable_routers(m, "prepare_accelerator")
            routing = info_of(m, "prepare_accelerator").routing
            if routing is not None and all(r is not routing for r in known + by_trainer):
                known.append(routing)
    if not known:
        return
    for optimizer in prepared:
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, torch.optim.Optimizer):
            for routing in (r for r in known if not r.tracked):  # one step hook per model: the first optimizer
                inner.register_step_post_hook(lambda *_, r=routing: r.step())
                routing.tracked = True
    if not vars(accelerator).get("hp_routing_logs"):
        log = accelerator.log

        def log_with_routing(values, step=None, *args, **kwargs):
            extra = {}
            for i, routing in enumerate(r for r in known if r.log):
                stats = _take(routing)
                if stats is None:
                    continue
                if accelerator.project_dir is not None and accelerator.is_main_process:
                    _append(Path(accelerator.project_dir) / ROUTING_LOG.replace(".jsonl", f"{i or ''}.jsonl"),
                            step, stats)
                logs = stats.logs()
                extra.update(logs if i == 0 else {k.replace("moe/", f"moe{i}/", 1): v for k, v in logs.items()})
            return log({**values, **extra}, step, *args, **kwargs)

        accelerator.log = log_with_routing
        accelerator.hp_routing_logs = True
