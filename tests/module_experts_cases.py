"""The transformers families whose experts are not one 3-D holder, at EP=2, each rank in a real gloo
world, against the unmodified model: Switch Transformers and NLLB-MoE (encoder-decoders whose experts
are a ModuleDict of MLPs, routed with capacity) and JetMoE (3-D expert weights in two sub-modules of
the block)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from hp_rewrite import sync_gradients
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.binding.install import expert_weights, local_rows
from hp_rewrite.tiny import build_tiny_model, tiny_config

#: training with every dropout and LayerDrop at 0 (both refused in training), no router
#: jitter; NLLB's capacity above the batch's tokens (its router caps over the whole batch, so a rank's
#: share would drop other tokens than the concatenated batch: true of any data-parallel run)
NO_DROPOUT = {
    "switch_transformers": {"dropout_rate": 0.0, "router_jitter_noise": 0.0},
    "nllb-moe": {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "moe_token_dropout": 0.0,
                 "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "expert_capacity": 1000, "moe_eval_capacity_token_fraction": 1.0},
    "jetmoe": {"attention_dropout": 0.0},
}


def config(model_type: str, overrides: dict):
    cfg = tiny_config(model_type)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def step(ref, ours, rank: int, world: int, training: bool) -> dict:
    """One forward and backward of this rank's share against the reference on the whole batch."""
    for m in (ref, ours):
        m.train(training)
        m.zero_grad(set_to_none=True)
    vocab = ref.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    src = torch.randint(4, vocab, (2 * world, 7), generator=gen)
    tgt = torch.randint(4, vocab, (2 * world, 5), generator=gen)
    mine = slice(2 * rank, 2 * rank + 2)

    def loss_of(model, rows):
        if not model.config.is_encoder_decoder:  # a causal LM: its own next tokens
            logits = model(input_ids=tgt[rows]).logits
            return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tgt[rows].roll(-1, 1).reshape(-1))
        logits = model(input_ids=src[rows], decoder_input_ids=tgt[rows]).logits
        return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tgt[rows].roll(-1, 1).reshape(-1))

    theirs, loss = loss_of(ref, slice(None))
    loss.backward()
    logits, loss = loss_of(ours, mine)
    loss.backward()
    sync_gradients(ours)
    weights = expert_weights(ours)  # 3-D expert weights (JetMoE's): this rank's rows of the reference
    want = {n: local_rows(*weights[n], _grad(p)) if n in weights else _grad(p) for n, p in ref.named_parameters()}
    floor = 1e-3 * max(g.abs().max().item() for g in want.values())
    errs = {n: ((_grad(p) - want[n]).abs().max() / max(want[n].abs().max().item(), floor)).item()
            for n, p in ours.named_parameters()}
    return {"logits_rel": ((logits - theirs[mine]).abs().max() / theirs[mine].abs().max()).item(),
            "grad_worst": max(errs.values()), "grad_worst_name": max(errs, key=errs.get)}


def ep2_module_experts(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    out = {}
    for model_type, overrides in NO_DROPOUT.items():
        ref = build_tiny_model(config(model_type, overrides), seed=0)
        ours = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
        held = sorted({n.split(".experts.")[1].split(".")[0] for n, _ in ours.named_parameters() if ".experts." in n})
        local = [installed.binding(m).placement.num_local for m in ours.modules() if installed.is_holder(m)]
        out[model_type] = {"held": held, "local": local, "patched": len(ours.hp_rewrite.patched),
                           "eval": step(ref, ours, rank, world, training=False),
                           "train": step(ref, ours, rank, world, training=True)}
        if model_type == "nllb-moe":  # LayerDrop: ranks would skip different layers
            ours.config.decoder_layerdrop = 0.05
            try:
                step(ref, ours, rank, world, training=True)
                out[model_type]["layerdrop"] = "ran"
            except Exception as e:  # noqa: BLE001 (the message is what the test checks)
                out[model_type]["layerdrop"] = str(e)
    return out
