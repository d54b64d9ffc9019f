"""MXFP4 and block-FP8 checkpoints (tiny, in the Hub's exact layouts: index json, three shards,
per-expert FP8 keys with FP8 attention, fused MXFP4 blocks) load expert-parallel, each rank reading
and dequantising only its experts: bit-equal to plain transformers' dequantised load at EP=1, 2 and
4 (bf16, the checkpoints' dtype), the same through ``Mxfp4Config`` / ``FineGrainedFP8Config(dequantize=True)``,
logits and every gradient of one step within 1e-5 of the unmodified model in fp32, saved as a plain
checkpoint, resumed from a distributed checkpoint, and read straight into FSDP2 shards
(``load_fully_sharded``); everything else refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hp_rewrite
from hp_rewrite.launch import run_world
from hp_rewrite.loading.local import load_expert_parallel
from hp_rewrite.loading.quantized import (
    QuantizedCheckpointError,
    checkpoint_format,
    dequantize_fp8,
    dequantize_mxfp4,
    quantize_fp8,
    quantize_mxfp4,
)
from hp_rewrite.plan import DEFAULT_PLAN
from hp_rewrite.runtime.group.groups import ExpertParallelGroup

from .quantized_cases import CHECKPOINTS, file_bytes, make_checkpoint, mismatches, plain

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {name: make_checkpoint(name, root / name) for name in CHECKPOINTS}


def test_codecs_round_trip_and_ragged_fp8_blocks() -> None:
    w = torch.randn(3, 20, 64)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 20, 2, 16) and scales.shape == (3, 20, 2) and blocks.dtype == torch.uint8
    back = dequantize_mxfp4(blocks, scales)
    group_max = w.unflatten(-1, (2, 32)).abs().amax(-1, keepdim=True)  # E2M1 steps are at most 2 ** scale < max / 3
    assert back.shape == w.shape and ((back - w).unflatten(-1, (2, 32)).abs() <= group_max / 3).all()
    # block FP8 whose dims the block does not divide (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in
    # 128-row blocks): the scale grid rounds up, each value takes its own block's scale
    m = torch.randn(13, 10)
    q, s = quantize_fp8(m, (8, 4))
    assert s.shape == (2, 3)
    want = torch.stack([torch.stack([q[i, j].float() * s[i // 8, j // 4] for j in range(10)]) for i in range(13)])
    assert torch.equal(dequantize_fp8(q, s, (8, 4)), want)
    assert torch.equal(dequantize_fp8(q[9:], s[1:], (8, 4), first_row=9), want[9:])
    exponents = torch.tensor([[120, 127, 130], [0, 255, 127]], dtype=torch.uint8)  # UE8M0 scales (MXFP8)
    powers = torch.exp2(exponents.float() - 127)
    assert torch.equal(dequantize_fp8(q, exponents, (8, 4)),
                       dequantize_fp8(q, powers, (8, 4)))


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_ep1_bit_equal_to_plain_transformers(name, checkpoints, tmp_path) -> None:
    full = plain(checkpoints[name])
    model = hp_rewrite.from_pretrained(checkpoints[name], plan=DEFAULT_PLAN, artifact_dir=tmp_path)
    direct, report = load_expert_parallel(checkpoints[name], DEFAULT_PLAN, ExpertParallelGroup.single(), tmp_path)
    for m in (model, direct):
        assert type(m) is type(full) and m.dtype == full.dtype == torch.bfloat16
        assert not hasattr(m.config, "quantization_config") and not hasattr(full.config, "quantization_config")
        assert mismatches(m, full) == []
    assert report["quantization"] == CHECKPOINTS[name][1]
    assert report["bytes_read"] == model.hp_rewrite.load_report["bytes_read"] == file_bytes(checkpoints[name])[0]


def test_ep2_and_ep4_local_experts_bit_equal_step_and_save(checkpoints, tmp_path) -> None:
    payload = {"checkpoints": {k: str(v) for k, v in checkpoints.items()}, "artifacts": str(tmp_path / "art"),
               "saved": str(tmp_path / "saved")}
    ranks = run_world(4, "tests.quantized_cases:world_case", payload, timeout=600)
    for name, model_dir in checkpoints.items():
        total, experts = file_bytes(model_dir)
        for rank, r in enumerate(ranks):
            for ep in (2, 4):
                got = r[name][f"ep{ep}"]
                assert got["mismatched"] == [] and got["direct_mismatched"] == [], (name, rank, ep, got)
                assert (got["class"], got["dtype"], got["quantization_config"]) == (
                    type(plain(model_dir)).__name__, "torch.bfloat16", False)
                # each rank reads its share of the experts' codes and scales, everything else once
                share = total - experts + experts // ep
                assert got["bytes_read"] == got["direct_bytes_read"] == share, (name, rank, ep, got, share)
            step = r[name]["step"]
            assert step["logits_rel"] <= TOL and step["grad_worst"] <= TOL, (name, rank, step)
            assert r[name]["resume_mismatched"] == [] and r[name]["sharded_mismatched"] == [], (name, rank, r[name])
        saved = ranks[0][name]["saved"]
        assert saved == {"quantization_config": False, "mismatched": [], "dtype": "torch.bfloat16"}, saved
        # dequantize=False: the experts kept as codes at EP 4 (quantized_cases.kept_case), LoRA trained on them,
        # runtime.balance forced on
        expert_codes = sum(n for k, n in file_bytes(model_dir, per_key=True).items()
                           if ".experts." in k and not k.endswith("_bias"))
        for rank, r in enumerate(ranks):
            kept = r["kept"][name]
            assert kept["kept"] == kept["expert_weights"] > 0 and kept["decoded_mismatched"] == [], (name, rank, kept)
            assert kept["stored_share"] == expert_codes // 4, (name, rank, kept)  # the codes and scales as read
            assert kept["expert_adapters"] > 0 and kept["trainable"] > kept["expert_adapters"], (name, kept)
            for what in ("logits_rel", "grad_worst", "step_worst", "plain_reads_adapter"):
                assert kept[what] <= TOL, (name, rank, what, kept)
            assert "write into an expert weight kept quantised" in kept["merge_refused"], kept
            assert "kept quantised" in kept["training_refused"] and "requires grad" in kept["training_refused"]
            # runtime.balance forced on: experts lent as their codes and scales with their adapters (#61)
            assert kept["lent_or_guests"] > 0 and kept["fsdp_lent_or_guests"] > 0, (name, rank, kept)
            assert all(b < kept["dense_bytes"] / 2 for b in kept["lent_bytes"]), (name, rank, kept)  # not decoded
            # under hp_rewrite.fully_shard: the codes left as loaded, the adapters sharded, one more step exact
            # (at EP 2: twice the experts per rank, their adapters sharded over the 2 expert replicas)
            assert kept["fsdp_codes_kept"] == kept["kept"] and kept["fsdp_adapters_sharded"], (name, rank, kept)
            assert kept["fsdp_expert_adapter_mesh"] == 2, (name, rank, kept)
            assert kept["fsdp_grad_worst"] <= TOL and kept["fsdp_step_worst"] <= TOL, (name, rank, kept)
            assert "keeps its experts quantised (dequantize=False)" in kept["dcp_refused"], kept
        assert ranks[0]["kept"][name]["saved_mismatched"] == []  # a full save: the dequantised checkpoint
        assert any(r["kept"][name]["lent_bytes"] for r in ranks), name  # some rank lent experts


@pytest.mark.parametrize(("config", "named"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "gptq", "bits": 4}, "GPTQ"),
    ({"quant_method": "awq", "bits": 4}, "AWQ"),
    ({"quant_method": "compressed-tensors"}, "compressed-tensors"),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
])
def test_other_quantisations_are_refused_by_name(config, named) -> None:
    with pytest.raises(QuantizedCheckpointError, match=named):
        checkpoint_format(config)


def test_quantising_at_load_and_keeping_what_is_read_whole_are_refused(checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, FineGrainedFP8Config, GptOssForCausalLM, Mxfp4Config

    from hp_rewrite.tiny import make_tiny

    state = {}
    for f in sorted(checkpoints["gpt_oss-mxfp4"].glob("*.safetensors")):
        state.update(load_file(f))
    with hp_rewrite.auto_patch(DEFAULT_PLAN, artifact_dir=tmp_path), pytest.raises(
            QuantizedCheckpointError, match="cannot be kept quantised here: from_pretrained.state_dict"):
        GptOssForCausalLM.from_pretrained(None, config=AutoConfig.from_pretrained(checkpoints["gpt_oss-mxfp4"]),
                                          state_dict=state, quantization_config=Mxfp4Config(dequantize=False))
    bf16 = make_tiny("qwen3_moe", tmp_path / "plain")
    with pytest.raises(QuantizedCheckpointError, match="on an unquantised checkpoint quantises it at load"):
        hp_rewrite.from_pretrained(bf16, plan=DEFAULT_PLAN, artifact_dir=tmp_path,
                                   quantization_config=FineGrainedFP8Config(dequantize=True))


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_cost_counts_the_stored_bytes_each_rank_reads(name, checkpoints, capsys) -> None:
    """`cost` counts, from the shapes alone, exactly the bytes of the files each rank reads at load."""
    import json

    from hp_rewrite.cli import main

    plans = Path(__file__).resolve().parent.parent / "plans"
    total, experts = file_bytes(checkpoints[name])
    for ep in (2, 4):
        capsys.readouterr()
        assert main(["cost", str(plans / "auto-ep2.yaml"), str(checkpoints[name]), "--seq-len", "8",
                     "--micro-batch", "1", "--ep", str(ep), "--json"]) == 0
        load = json.loads(capsys.readouterr().out)["load"]
        assert (load["format"], load["dequantized_to"]) == (CHECKPOINTS[name][1], "bfloat16")
        assert (load["total_bytes"], load["expert_bytes"]) == (total, experts)
        assert load["per_rank_bytes"] == total - experts + experts // ep


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_cost_of_lora_on_kept_experts(name, checkpoints, tmp_path, capsys) -> None:
    """`cost --lora R --keep-quantized`: each rank's frozen experts cost exactly the stored bytes of its
    share of the files (what kept_case measures resident), its adapters 16 bytes a parameter (fp32
    weight, gradient, AdamW moments); what cannot be costed is refused with the fix."""
    import json

    from hp_rewrite.cli import main

    plan = str(Path(__file__).resolve().parent.parent / "plans" / "auto-ep2.yaml")
    sizes = file_bytes(checkpoints[name], per_key=True)
    experts = sum(n for k, n in sizes.items() if ".experts." in k)
    capsys.readouterr()
    args = ["cost", plan, str(checkpoints[name]), "--seq-len", "8", "--micro-batch", "1", "--ep", "2"]
    assert main([*args, "--lora", "4", "--keep-quantized", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["cost"]["layers"]
    held = sum(lay["memory"]["expert_params"] - lay["memory"]["expert_grads"] for lay in layers)
    assert held == experts / 2
    assert all(lay["memory"]["expert_optimizer"] == 2 * lay["memory"]["expert_grads"] > 0 for lay in layers)
    # runtime.balance's copies of these experts: their codes and the factors go, only the factors' gradient returns
    assert main([*args, "--lora", "4", "--keep-quantized", "--balance-skew", "2", "--json"]) == 0
    copy = json.loads(capsys.readouterr().out)["balance"]["copy"]
    assert 0 < copy["returned_bytes"] < copy["sent_bytes"], copy
    assert main([*args, "--lora", "4"]) == 0  # dequantised: the experts in bf16
    assert "frozen expert weights + LoRA r=4 states" in capsys.readouterr().out
    assert main([*args, "--keep-quantized"]) == 2
    assert "cost the adapters trained on them with --lora R" in "".join(capsys.readouterr())
    assert main([*args, "--lora", "4", "--world-size", "4", "--suggest", "--non-expert", "fully_shard"]) == 2
    assert "use --non-expert replicate" in "".join(capsys.readouterr())
    from hp_rewrite.tiny import make_tiny

    plain_dir = make_tiny("qwen3_moe", tmp_path / "plain")
    assert main(["cost", plan, str(plain_dir), "--seq-len", "8", "--micro-batch", "1", "--lora", "4",
                 "--keep-quantized"]) == 2
    assert "is not an MXFP4 or block-FP8 checkpoint" in "".join(capsys.readouterr())


def test_key_mapping_and_a_refused_checkpoint_through_from_pretrained(checkpoints, tmp_path) -> None:
    """The user's key_mapping still applies once the quantiser's conversions give way to the model's;
    a bitsandbytes checkpoint is refused before transformers (or bitsandbytes) sees it."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed"
    shutil.copytree(checkpoints["deepseek_v3-fp8"], renamed)
    index_file = renamed / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    file = index["weight_map"].pop("model.norm.weight")
    tensors = load_file(renamed / file)
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, renamed / file, metadata={"format": "pt"})
    index["weight_map"]["model.final_norm.weight"] = file
    index_file.write_text(json.dumps(index))
    mapping = {r"model\.final_norm": "model.norm"}
    model = hp_rewrite.from_pretrained(renamed, plan=DEFAULT_PLAN, artifact_dir=tmp_path / "art", key_mapping=mapping)
    assert mismatches(model, plain(renamed, key_mapping=mapping)) == []

    bnb = tmp_path / "bnb"
    shutil.copytree(checkpoints["qwen3_moe-fp8"], bnb)
    config = json.loads((bnb / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bnb / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizedCheckpointError, match="quantised with bitsandbytes"):
        hp_rewrite.from_pretrained(bnb, plan=DEFAULT_PLAN, artifact_dir=tmp_path / "art")


def test_remote_code_fp8_checkpoint_with_module_list_experts(tmp_path) -> None:
    """A trust_remote_code model (experts an nn.ModuleList of Linear MLPs, as Kimi-K2's own code holds
    them) in block FP8: each expert module's weights bit-equal to plain transformers' dequantised load."""
    import transformers

    from hp_rewrite.tiny import as_bf16, write_quantized

    from .remote_code import write_checkpoint

    source = write_checkpoint(tmp_path / "remote", router="softmax", seed=0)
    model = as_bf16(transformers.AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True))
    model.save_pretrained(tmp_path / "fp8")
    write_quantized(model, tmp_path / "fp8", "fp8")
    full = plain(tmp_path / "fp8", trust_remote_code=True)
    ours = hp_rewrite.from_pretrained(tmp_path / "fp8", plan=DEFAULT_PLAN, artifact_dir=tmp_path / "art",
                                      trust_remote_code=True)
    assert ours.hp_rewrite.patched and ours.hp_rewrite.load_report["quantization"] == "fp8"
    theirs = full.state_dict()
    assert [k for k, v in ours.state_dict().items() if v.dtype != theirs[k].dtype or not torch.equal(v, theirs[k])] == []
