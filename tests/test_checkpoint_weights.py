"""``checkpoint_weights`` without a world (the worlds: tests/weights_cases.py): a model transformers built
streams what its save_pretrained writes; what it cannot stream exactly is refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hp_rewrite import checkpoint_weights
from hp_rewrite.errors import UserError
from hp_rewrite.hf import quiet_transformers
from hp_rewrite.tiny import build_tiny_model, tiny_config

from .weights_cases import compare


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_an_unmodified_model_streams_its_saved_files(family: str, tmp_path) -> None:
    model = build_tiny_model(tiny_config(family), seed=0).to(torch.bfloat16)
    with quiet_transformers():
        model.save_pretrained(tmp_path)
    assert not compare(list(checkpoint_weights(model)), load_file(tmp_path / "model.safetensors"), family)


@pytest.mark.parametrize("kind", ["dora", "ia3", "modules_to_save"])
def test_adapters_it_cannot_add_exactly_are_refused(kind: str) -> None:
    from peft import IA3Config, LoraConfig, get_peft_model

    model = build_tiny_model(tiny_config("qwen3_moe"), seed=0)
    config = {"dora": LoraConfig(r=2, target_modules=["q_proj"], use_dora=True),
              "ia3": IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
              "modules_to_save": LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])}[kind]
    peft_model = get_peft_model(model, config)
    with pytest.raises(UserError, match="merge_and_unload"):
        next(iter(checkpoint_weights(peft_model)))


def test_a_rank_outside_the_world_is_refused() -> None:
    model = build_tiny_model(tiny_config("qwen3_moe"), seed=0)
    with pytest.raises(UserError, match="dst=1 is not a rank"):
        next(iter(checkpoint_weights(model, dst=1)))
