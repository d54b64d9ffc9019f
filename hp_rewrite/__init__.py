"""hp-rewrite: expert-parallel rewriting of transformers Mixture-of-Experts models.

``hp_rewrite.auto_patch(plan)`` / ``hp_rewrite.from_pretrained(model_dir, plan=...)`` return
rewritten models; ``hp_rewrite.sync_gradients(model)`` applies the EP x DP gradient contract after
backward, ``hp_rewrite.gradient_sync(model)`` during it (bucketed, like DDP);
``hp_rewrite.Interleaver`` (``hp_rewrite.interleave(steps)`` for one call) runs micro-batches that
compute while another one's all-to-all is in flight. Inside DDP, Trainer (``prepare_trainer``),
accelerate, torch.compile and PEFT a rewritten model is exact as it is (docs/training.md);
``fully_shard`` / ``load_fully_sharded`` shard it with FSDP2, ``clip_grad_norm_`` clips it,
``save_checkpoint`` / ``load_checkpoint`` resume it. ``routing_stats`` / ``track_routing`` report and
step the routing in a loop, ``record_routing`` / ``replay_routing`` (``Routes``) replay recorded experts
(docs/training.md, Routing), ``rollout_routes`` those an inference engine chose (``Rollout``,
``sglang_routed_experts``, ``vllm_returns_routes``); ``checkpoint_weights`` streams the weights to one. The routed runtime that generated code calls lives in
:mod:`hp_rewrite.runtime`.
"""

__version__ = "0.1.0"

_LAZY = {
    "auto_patch": "hp_rewrite.loading.patch",
    "from_pretrained": "hp_rewrite.loading.patch",
    "AutoPatch": "hp_rewrite.loading.patch",
    "rewrite_model": "hp_rewrite.loading.patch",
    "sync_gradients": "hp_rewrite.training.rewritten",
    "gradient_sync": "hp_rewrite.training.rewritten",
    "prepare_trainer": "hp_rewrite.training.trainer",
    "prepare_accelerator": "hp_rewrite.training.accelerator",
    "fully_shard": "hp_rewrite.training.fsdp",
    "load_fully_sharded": "hp_rewrite.training.sharded_load",
    "clip_grad_norm_": "hp_rewrite.training.fsdp",
    "save_checkpoint": "hp_rewrite.training.checkpoint",
    "load_checkpoint": "hp_rewrite.training.checkpoint",
    "routing_stats": "hp_rewrite.training.routing",
    "track_routing": "hp_rewrite.training.routing",
    "record_routing": "hp_rewrite.runtime.routing.replay",
    "replay_routing": "hp_rewrite.runtime.routing.replay",
    "Routes": "hp_rewrite.runtime.routing.replay",
    "Rollout": "hp_rewrite.training.rollout",
    "rollout_routes": "hp_rewrite.training.rollout",
    "sglang_routed_experts": "hp_rewrite.training.rollout",
    "vllm_returns_routes": "hp_rewrite.training.rl",
    "rank_local_names": "hp_rewrite.sync.gradients",
    "save_pretrained": "hp_rewrite.loading.save",
    "checkpoint_weights": "hp_rewrite.loading.weights",
    "interleave": "hp_rewrite.runtime.overlap.turns",
    "Interleaver": "hp_rewrite.runtime.overlap.turns",
    "UserError": "hp_rewrite.errors",  # every mistake the user can fix (also of transformers' type where it raises)
}


def __getattr__(name: str):
    """Import the heavy parts (torch, transformers) only when they are used."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hp_rewrite' has no attribute {name!r}")
