"""The transformers families whose experts are not one 3-D holder (#23 item 4): Switch Transformers and
NLLB-MoE (a ModuleDict of per-expert MLPs, driven by the model's own capacity routers through the
experts-level archetype) and JetMoE (its MoE block holds 3-D expert weights in two sub-modules: the
block-level self-held archetype; its mixture-of-attention experts stay refused with the reason).
Parity at EP=1 and EP=2 in eval mode and in training with dropout off (logits and every gradient,
fp32 1e-5); training with a dropout inside the experts is refused with the reason (its masks cannot be
reproduced)."""

from __future__ import annotations

import copy

import pytest
import torch

from hp_rewrite.launch import run_world
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import Plan
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.tiny import build_tiny_model

from .module_experts_cases import NO_DROPOUT, config, step

TOL = 1e-5
EP1 = Plan.model_validate({"version": 1, "ep_size": 1})


@pytest.mark.parametrize("model_type", sorted(NO_DROPOUT))
def test_ep1_eval_and_training_without_dropout(model_type, tmp_path) -> None:
    ref = build_tiny_model(config(model_type, NO_DROPOUT[model_type]), seed=0)
    ours = rewrite_model(copy.deepcopy(ref), EP1, artifact_dir=tmp_path)
    # encoder-decoders: two sparse layers in the encoder, two in the decoder; JetMoE: its two MoE blocks
    assert len(ours.hp_rewrite.patched) == (2 if model_type == "jetmoe" else 4)
    for training in (False, True):
        r = step(ref, ours, 0, 1, training)
        assert r["logits_rel"] <= TOL and r["grad_worst"] <= TOL, (training, r)


@pytest.mark.parametrize(("model_type", "field", "p"), [("switch_transformers", "dropout_rate", 0.1),
                                                        ("nllb-moe", "moe_token_dropout", 0.2)])
def test_training_with_dropout_in_the_experts_is_refused(model_type, field, p, tmp_path) -> None:
    """Eval is exact (NLLB's 1 - p output scale included); training would draw other masks: refused."""
    overrides = {**NO_DROPOUT[model_type], field: p}
    ref = build_tiny_model(config(model_type, overrides), seed=0)
    ours = rewrite_model(copy.deepcopy(ref), EP1, artifact_dir=tmp_path)
    r = step(ref, ours, 0, 1, training=False)
    assert r["logits_rel"] <= TOL and r["grad_worst"] <= TOL, r
    ours.train()
    ids = torch.randint(4, 60, (1, 5))
    with pytest.raises(ExpertParallelError, match=rf"dropout \(p={p}\) inside the experts is active in training"):
        ours(input_ids=ids, decoder_input_ids=ids)


def test_ep2_local_experts_eval_and_training(tmp_path) -> None:
    ranks = run_world(2, "tests.module_experts_cases:ep2_module_experts", {"out_dir": str(tmp_path)}, timeout=400)
    for model_type in NO_DROPOUT:
        r0, r1 = ranks[0][model_type], ranks[1][model_type]
        if model_type != "jetmoe":  # the expert modules under their original keys, this rank's only
            assert r0["held"] == [f"expert_{e}" for e in range(4)] and r1["held"] == [f"expert_{e}" for e in range(4, 8)]
        for r in (r0, r1):
            assert r["local"] == [4] * r["patched"] and r["patched"] == (2 if model_type == "jetmoe" else 4)
            for mode in ("eval", "train"):
                assert r[mode]["logits_rel"] <= TOL and r[mode]["grad_worst"] <= TOL, (model_type, mode, r[mode])
