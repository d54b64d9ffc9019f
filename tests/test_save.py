"""Saving: EP=2 -> standard checkpoint -> plain transformers (identical logits) and -> EP=4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hp_rewrite.launch import run_world
from hp_rewrite.match import find_blocks
from hp_rewrite.tiny import make_tiny

from .save_cases import assert_same_files

TOL = 1e-6  # safetensors-loaded storage may be unaligned: grouped GEMM then differs by ~1e-7


# dbrx: flat [E*I, H] experts; longcat_flash: zero experts' gate_up_proj rows, kept on every rank
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "dbrx", "longcat_flash"])
def test_save_at_ep2_loads_in_plain_transformers_and_at_ep4(model_type: str, tmp_path: Path) -> None:
    original = make_tiny(model_type, tmp_path / "original")
    saved = tmp_path / "saved"
    payload = {"ep_size": 2, "model_dir": str(original), "out_dir": str(saved), "gen_dir": str(tmp_path / "gen")}
    ranks = run_world(2, "tests.save_cases:load_and_save", payload)
    assert ranks[0]["local"] and all(n == ranks[0]["local"][0] for n in ranks[0]["local"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"

    plain = AutoModelForCausalLM.from_pretrained(original, attn_implementation="eager")
    plain.save_pretrained(tmp_path / "plain-saved")  # gathered at EP=2, the files are what transformers writes
    assert (saved / "model.safetensors").is_file() and not (saved / "model.safetensors.index.json").exists()
    assert_same_files(saved, tmp_path / "plain-saved")
    reloaded = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager")
    for (name, a), (_, b) in zip(plain.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        a, b = plain(input_ids=ids).logits, reloaded(input_ids=ids).logits
    assert ((a - b).abs().max() / b.abs().max()).item() <= TOL

    if model_type == "qwen3_moe":  # saved at EP=2, loaded at EP=4
        results = run_world(4, "tests.save_cases:load_and_compare",
                            {"model_dir": str(saved), "reference_dir": str(original), "gen_dir": str(tmp_path / "gen")})
        assert all(r["rel"] <= TOL for r in results), results


@pytest.mark.parametrize("model_type", ["qwen3_moe", "dbrx"])
def test_save_with_balanced_placement_restores_expert_order(model_type: str, tmp_path: Path) -> None:
    """Experts spread over the ranks by the plan's placement are written back in expert order."""
    original = make_tiny(model_type, tmp_path / "original")
    plain = AutoModelForCausalLM.from_pretrained(original, attn_implementation="eager")
    loads = {s.path: [(e % 2) * 100 + e for e in range(s.num_experts)] for s in find_blocks(plain)}
    plan = f"version: 1\nep_size: 2\nplacement:\n  strategy: balanced\n  loads: {json.dumps(loads)}\n"
    saved = tmp_path / "saved"
    payload = {"plan": plan, "model_dir": str(original), "out_dir": str(saved), "gen_dir": str(tmp_path / "gen")}
    ranks = run_world(2, "tests.save_cases:load_and_save", payload)
    experts = ranks[0]["local_experts"][0]
    assert experts != list(range(len(experts))), "the placement kept consecutive experts: nothing tested"
    reloaded = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager")
    for (name, a), (_, b) in zip(plain.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_save_into_an_existing_directory_keeps_what_is_not_weights(tmp_path: Path) -> None:
    """A Trainer run directory (or a checkpoint folder) is saved into, not replaced: other files stay,
    an earlier save's shards that the new index does not name go, plain transformers loads the result."""
    import hp_rewrite

    original = make_tiny("qwen3_moe", tmp_path / "original")
    model = hp_rewrite.from_pretrained(original, plan=Path(__file__).parent.parent / "plans" / "auto-ep2.yaml",
                                       artifact_dir=tmp_path / "gen", single_process=True)  # no world: EP 1
    out = tmp_path / "run"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "checkpoint-5" / "trainer_state.json").write_text("{}")
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    hp_rewrite.save_pretrained(model, out)
    assert (out / "checkpoint-5" / "trainer_state.json").read_text() == "{}"
    assert not (out / "model-00009-of-00009.safetensors").exists()
    plain = AutoModelForCausalLM.from_pretrained(original, attn_implementation="eager")
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    for (name, a), (_, b) in zip(plain.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
