"""Experts the checkpoint lacks (#44), in one process. The multi-rank comparisons with plain transformers
(EP 2, EP 4, TP-extended EP) run in the worlds of tests/test_transformers_contract.py and tests/test_tp.py
(tests/missing_experts_cases.py); here what needs no world: experts kept quantised cannot be drawn, and
the random stream is left where plain transformers leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import hp_rewrite
from hp_rewrite.hf import quiet_transformers
from hp_rewrite.loading.quantized import QuantizedCheckpointError
from hp_rewrite.plan import Plan
from hp_rewrite.tiny import build_tiny_model, tiny_config, write_quantized

EP1 = Plan.model_validate({"version": 1, "ep_size": 1})


def _fp8_without_layer(out: Path) -> Path:
    """A block-FP8 Qwen3-MoE checkpoint (one shard and its index) without layer 1's routed experts."""
    model = build_tiny_model(tiny_config("qwen3_moe"), seed=0).to(torch.bfloat16)
    with quiet_transformers():
        model.save_pretrained(out)
    write_quantized(model, out, "fp8", shards=1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / next(iter(set(index["weight_map"].values())))
    kept = {k: t for k, t in load_file(shard).items() if ".layers.1.mlp.experts." not in k}
    save_file(kept, shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in kept}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_experts_kept_quantised_cannot_be_missing(tmp_path) -> None:
    """Kept as the checkpoint's codes, missing experts have no codes: refused by name with the fix;
    dequantised they load, drawn as plain transformers draws them."""
    directory = _fp8_without_layer(tmp_path / "fp8")
    kept = transformers.FineGrainedFP8Config(dequantize=False)
    with pytest.raises(QuantizedCheckpointError) as e, hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=kept)
    assert "model.layers.1.mlp.experts." in str(e.value) and "dequantize=True" in str(e.value), e.value
    dequantized = transformers.FineGrainedFP8Config(dequantize=True)
    torch.manual_seed(0)
    with quiet_transformers():
        plain = transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=dequantized)
    after_plain = torch.random.get_rng_state()
    torch.manual_seed(0)
    with quiet_transformers(), hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        ours = transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=dequantized)
    assert torch.equal(torch.random.get_rng_state(), after_plain)  # the random stream left where plain leaves it
    for name, t in plain.state_dict().items():
        assert torch.equal(ours.state_dict()[name], t), name
