"""RL trainers that generate with an inference engine: TRL's vLLM weight sync streams the checkpoint.

TRL's ``VLLMGeneration.sync_weights`` (GRPO, RLOO and the other online trainers with ``use_vllm``)
walks ``named_parameters()``: for an expert-parallel model that is each rank's slice of the fused
expert tensors under the full tensor's name, where vLLM's loaders read the Hub's names (per-expert
``mlp.experts.{i}.gate_proj.weight`` for Qwen3-MoE and DeepSeek-V3, whole fused tensors for gpt-oss).
:func:`install_weight_sync` makes it send :func:`~hp_rewrite.loading.weights.checkpoint_weights`
instead: to every rank's colocated engine (``vllm_mode="colocate"``), or to the main process, which
pushes to the server (``"server"``); the other ranks join the gathers.
"""

from __future__ import annotations

from ..loading.weights import checkpoint_weights
from ..runtime import ExpertParallelError


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
