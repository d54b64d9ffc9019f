"""RL trainers that generate with an inference engine: TRL's vLLM weight sync streams the checkpoint.

TRL's ``VLLMGeneration.sync_weights`` (GRPO, RLOO and the other online trainers with ``use_vllm``)
walks ``named_parameters()``: for an expert-parallel model that is each rank's slice of the fused
expert tensors under the full tensor's name, where vLLM's loaders read the Hub's names (per-expert
``mlp.experts.{i}.gate_proj.weight`` for Qwen3-MoE and DeepSeek-V3, whole fused tensors for gpt-oss).
:func:`install_weight_sync` makes it send :func:`~hp_rewrite.loading.weights.checkpoint_weights`
instead: to every rank's colocated engine (``vllm_mode="colocate"``), or to the main process, which
pushes to the server (``"server"``); the other ranks join the gathers.

With the plan's ``routing.replay_rollout``, :func:`install_rollout_replay` makes a prepared GRPOTrainer
replay in its training forwards the experts its colocated vLLM engine chose (rollout routing replay,
:mod:`.rollout`); :func:`vllm_returns_routes` makes TRL build that engine returning them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..loading.record import record_of, rewritten_model
from ..loading.weights import checkpoint_weights
from ..runtime.errors import ExpertParallelError
from ..runtime.routing.replay import Routes, replay_disagreement, replay_routing
from .rollout import Rollout, place_rollouts, routes_of_placed


def install_weight_sync(trainer) -> None:
    """Point ``trainer``'s vLLM weight sync (if it has one) at :func:`checkpoint_weights`."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or getattr(generation, "hp_rewrite_weights", False):
        return
    if not hasattr(generation, "_iter_named_params") or generation.mode not in ("colocate", "server"):
        raise ExpertParallelError(
            f"prepare_trainer: {type(trainer).__name__}'s vLLM generation ({type(generation).__name__}, mode "
            f"{getattr(generation, 'mode', None)!r}) is not TRL's VLLMGeneration as hp-rewrite knows it; its weight "
            "sync would send each rank's slice of the experts under the full tensors' names. Use TRL >= 1.0 with "
            "vllm_mode 'colocate' or 'server', or feed the engine from hp_rewrite.checkpoint_weights(model)")
    dst = 0 if generation.mode == "server" else None  # the main process (global rank 0) pushes to the server
    model = generation.model
    generation._iter_named_params = lambda: checkpoint_weights(model, dst=dst)
    generation.hp_rewrite_weights = True


@contextmanager
def vllm_returns_routes():
    """While inside, TRL builds its colocated vLLM engine with ``enable_return_routed_experts=True`` (TRL
    has no option for it), so that a trainer prepared with ``routing.replay_rollout`` can replay the
    rollout's routes: ``with hp_rewrite.vllm_returns_routes(): trainer = GRPOTrainer(...)``."""
    from trl.generation import vllm_generation

    build = vllm_generation.LLM

    def llm_returning_routes(*args, **kwargs):
        return build(*args, **{**kwargs, "enable_return_routed_experts": True})

    vllm_generation.LLM = llm_returning_routes
    try:
        yield
    finally:
        vllm_generation.LLM = build


def _engine_flag(llm) -> bool | None:
    """Whether the vLLM engine was built to return routed experts (None: cannot tell; the outputs will)."""
    engine = getattr(llm, "llm_engine", None)
    config = getattr(getattr(engine, "vllm_config", None), "model_config", None) or getattr(engine, "model_config", None)
    return getattr(config, "enable_return_routed_experts", None)


class _Rollouts:
    """What a prepared trainer's vLLM engine routed, matched to the completions TRL keeps, in row order."""

    def __init__(self, model) -> None:
        self.model = model
        self.routed: dict[tuple, list] = {}  # (prompt ids, completion ids) -> routes, from the engine's outputs
        self.rows: list[Rollout] = []  # this generation's rollouts, in the batch's row order
        self.generated: torch.Tensor | None = None  # their [B, S, layers, K] placement, built once per generation
        self.placed: torch.Tensor | None = None  # the training step's slice of it (TRL's inputs carry it)

    def take_outputs(self, outputs) -> None:
        for out in outputs:
            for completion in out.outputs:
                routes = getattr(completion, "routed_experts", None)
                routes = getattr(out, "routed_experts", None) if routes is None else routes
                if routes is None:
                    raise ExpertParallelError(
                        "routing.replay_rollout: vLLM returned no routed_experts; build the trainer inside "
                        "hp_rewrite.vllm_returns_routes() (TRL builds its engine without enable_return_routed_experts)")
                key = (tuple(out.prompt_token_ids), tuple(completion.token_ids))
                self.routed.setdefault(key, []).append(torch.as_tensor(routes))

    def take_completions(self, prompt_ids, completion_ids) -> None:
        for prompt, completion in zip(prompt_ids, completion_ids, strict=True):
            found = self.routed.get((tuple(prompt), tuple(completion)))
            if not found:
                raise ExpertParallelError("routing.replay_rollout: a completion TRL kept is not one vLLM returned, so "
                                          "its routes are not known")
            self.rows.append(Rollout(list(prompt), list(completion), found.pop()))
        self.routed.clear()

    def placement(self, input_ids, prompt_width: int) -> torch.Tensor:
        """This generation's rollouts placed in its batch (checked and uploaded once, then reused)."""
        if self.generated is None or self.generated.shape[:2] != input_ids.shape:
            self.generated = place_rollouts(self.model, self.rows, input_ids, prompt_width).to(input_ids.device)
        return self.generated

    def routes(self, input_ids, logits_to_keep: int, batch_size) -> Routes:
        placed = self.placed
        if placed is None or placed.shape[:2] != input_ids.shape:  # a forward inside the generation's scoring
            placed = self.placement(input_ids, input_ids.shape[1] - logits_to_keep)
        return routes_of_placed(self.model, placed, batch_size, input_ids.device)


def _refuse_replay(trainer, generation) -> None:
    name = type(trainer).__name__
    if generation is None or not all(hasattr(trainer, f) for f in (
            "_generate_and_score_completions", "_compute_loss", "_get_per_token_logps_and_entropies")):
        raise ExpertParallelError(
            f"prepare_trainer: routing.replay_rollout replays a vLLM rollout's routes in TRL's GRPOTrainer "
            f"(use_vllm=True); {name} {'does not generate with vLLM' if generation is None else 'is not one'}. Set "
            "routing.replay_rollout: false, or replay routes yourself (hp_rewrite.rollout_routes, replay_routing)")
    if generation.mode != "colocate":
        raise ExpertParallelError(
            "prepare_trainer: routing.replay_rollout: TRL's vllm-serve neither records nor returns the experts it "
            "routes to; use vllm_mode='colocate' (inside hp_rewrite.vllm_returns_routes()), or feed the routes "
            "yourself (hp_rewrite.rollout_routes, replay_routing)")
    if getattr(trainer, "tools", None):
        raise ExpertParallelError("prepare_trainer: routing.replay_rollout: tool calls add tokens to the completions "
                                  "that vLLM never routed; replay is not supported with tools")
    if _engine_flag(generation.llm) is False:
        raise ExpertParallelError(
            "prepare_trainer: routing.replay_rollout: TRL built its vLLM engine without enable_return_routed_experts "
            "(it has no option for it); build the trainer inside `with hp_rewrite.vllm_returns_routes():`")


def install_rollout_replay(trainer) -> None:
    """With the plan's ``routing.replay_rollout``: every forward of the policy on a generation's samples
    (the old log-probabilities, the training forward and its recomputation, the reference when it is the
    same model) replays the experts vLLM chose for them (R3); ``moe/replay_disagreement`` logs how often
    the routers, left alone, would have chosen otherwise."""
    model = rewritten_model(trainer.model)
    if model is None or not record_of(model).plan.routing.replay_rollout or getattr(trainer, "hp_rollouts", None):
        return
    generation = getattr(trainer, "vllm_generation", None)
    _refuse_replay(trainer, generation)
    rollouts = trainer.hp_rollouts = _Rollouts(model)
    llm_generate, generate = generation.llm.generate, generation.generate
    score, compute_loss, logps, log = (trainer._generate_and_score_completions, trainer._compute_loss,
                                       trainer._get_per_token_logps_and_entropies, trainer.log)

    def engine_generate(*args, **kwargs):
        outputs = llm_generate(*args, **kwargs)
        rollouts.take_outputs(outputs)
        return outputs

    def generate_keeping_routes(*args, **kwargs):
        prompt_ids, completion_ids, *rest = generate(*args, **kwargs)
        rollouts.take_completions(prompt_ids, completion_ids)
        return (prompt_ids, completion_ids, *rest)

    def score_with_routes(*args, **kwargs):
        rollouts.rows, rollouts.generated = [], None
        output = score(*args, **kwargs)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        output["hp_routed_experts"] = rollouts.placement(ids, output["prompt_ids"].shape[1])
        rollouts.rows, rollouts.generated = [], None
        return output

    def loss_with_routes(model_, inputs, *args, **kwargs):
        rollouts.placed = inputs.get("hp_routed_experts")
        try:
            return compute_loss(model_, inputs, *args, **kwargs)
        finally:
            rollouts.placed = None

    def logps_replayed(model_, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
        if rewritten_model(model_) is not model:  # a separate reference model: routes of its own
            return logps(model_, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs)
        with replay_routing(model, rollouts.routes(input_ids, logits_to_keep, batch_size or input_ids.shape[0])):
            return logps(model_, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs)

    def log_with_disagreement(logs, *args, **kwargs):
        if not any(k.startswith("eval_") for k in logs):  # every rank logs (the reduction is collective)
            counts = replay_disagreement(model)
            counts = torch.zeros(2) if counts is None else torch.stack(counts).float().cpu()
            replayed, disagreed = trainer.accelerator.reduce(counts.to(trainer.accelerator.device), "sum").tolist()
            if replayed:
                logs = {**logs, "moe/replay_disagreement": disagreed / replayed}
        return log(logs, *args, **kwargs)

    generation.llm.generate, generation.generate = engine_generate, generate_keeping_routes
    trainer._generate_and_score_completions, trainer._compute_loss = score_with_routes, loss_with_routes
    trainer._get_per_token_logps_and_entropies, trainer.log = logps_replayed, log_with_disagreement
