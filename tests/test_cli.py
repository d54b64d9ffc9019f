"""The command line: the main job end to end, and user errors (message, exit 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hp_rewrite import __version__
from hp_rewrite.cli import main
from hp_rewrite.tiny import make_tiny

PLANS = Path(__file__).resolve().parent.parent / "plans"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe")


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out


def test_apply_nproc2_verify_writes_report(tiny_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    code = main(["apply", str(PLANS / "auto-ep2.yaml"), str(tiny_dir), "--out", str(tmp_path / "gen"),
                 "--nproc", "2", "--verify", "--report", str(report)])
    assert code == 0
    data = json.loads(report.read_text())
    assert data["verify"]["passed"] and data["verify"]["logits_max_rel"] <= 1e-5
    assert data["verify"]["grad_max_rel"] <= 1e-5
    m = data["modules"][0]
    assert m["archetype"]["level"] == "block" and m["local_experts"] == m["num_experts"] // 2 and m["top_k"] == 2
    assert data["unmatched"] == [] and all(Path(f).exists() for f in data["generated"])
    assert main(["inspect", str(tmp_path / "gen"), "--block", m["class"]]) == 0
    assert main(["inspect", str(tmp_path / "gen"), "--diff"]) == 0


def test_bad_plan_is_a_clean_error(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    plan = tmp_path / "bad.yaml"
    plan.write_text("version: 1\nep_size: 2\nruntime:\n  compute: fast\n")
    out = tmp_path / "gen"
    assert main(["apply", str(plan), str(tiny_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().out
    assert "bad.yaml:4" in err and "runtime.compute" in err and "grouped" in err and "Traceback" not in err
    assert not out.exists()


def test_missing_model_dir_is_a_clean_error(tmp_path: Path, capsys) -> None:
    assert main(["apply", str(PLANS / "auto-ep2.yaml"), str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().out


def test_unreadable_checkpoint_on_the_ranks_is_a_clean_error(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    """A user error raised on the ranks (here a corrupt safetensors file) is the CLI's message and exit 2."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{not json}" + b" " * 6)
    report = tmp_path / "report.json"
    plan = PLANS / "auto-ep2.yaml"
    code = main(["apply", str(plan), str(bad), "--out", str(tmp_path / "gen"), "--nproc", "2", "--verify",
                 "--report", str(report)])
    out = capsys.readouterr().out
    assert code == 2 and "model.safetensors: not a readable safetensors file" in out and "Traceback" not in out
    assert not report.exists()


def test_world_size_that_does_not_fit_the_plan(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["apply", str(PLANS / "auto-ep2.yaml"), str(tiny_dir), "--out", str(tmp_path), "--nproc", "3"]) == 2
    assert "not a multiple" in capsys.readouterr().out


def test_ep_size_that_does_not_divide_the_experts(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    plan = tmp_path / "ep3.yaml"
    plan.write_text("version: 1\nep_size: 3\n")
    assert main(["apply", str(plan), str(tiny_dir), "--out", str(tmp_path / "gen")]) == 2
    assert "does not divide" in capsys.readouterr().out


def test_inspect_without_artifact(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    assert "run hp-rewrite apply first" in capsys.readouterr().out


def test_dense_model_is_a_clean_error(tmp_path: Path, capsys) -> None:
    """A model without MoE blocks: a message, exit 2, nothing written (it wrote an empty artifact)."""
    dense = make_tiny("qwen3", tmp_path / "dense")
    out = tmp_path / "gen"
    assert main(["apply", str(PLANS / "auto-ep2.yaml"), str(dense), "--out", str(out)]) == 2
    msg = capsys.readouterr().out
    assert "no MoE block" in msg and "describe-moe" in msg and "Traceback" not in msg
    assert not out.exists()


def test_out_that_is_a_file_is_a_clean_error(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "a-file"
    out.write_text("keep me")
    assert main(["apply", str(PLANS / "auto-ep2.yaml"), str(tiny_dir), "--out", str(out)]) == 2
    msg = capsys.readouterr().out
    assert "is a file" in msg and "Traceback" not in msg and out.read_text() == "keep me"


def test_include_glob_that_selects_no_block_is_a_clean_error(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    plan = tmp_path / "none.yaml"
    plan.write_text("version: 1\nep_size: 2\nmodules:\n  include: ['model.layers.99.*']\n")
    out = tmp_path / "gen"
    assert main(["apply", str(plan), str(tiny_dir), "--out", str(out)]) == 2
    msg = capsys.readouterr().out
    assert "select none" in msg and "model.layers.0.mlp" in msg and "Traceback" not in msg
    assert not out.exists()


def test_cached_apply_neither_builds_the_model_nor_probes(tiny_dir: Path, tmp_path: Path, capsys,
                                                         monkeypatch) -> None:
    """A second apply with the same inputs recognises its artifact from the key and the recorded
    summary: no model is built, no archetype probe runs, the report is the same."""
    import hp_rewrite.apply as apply_library

    out, first, second = tmp_path / "gen", tmp_path / "first.json", tmp_path / "second.json"
    assert main(["apply", str(PLANS / "auto-ep2.yaml"), str(tiny_dir), "--out", str(out), "--report", str(first)]) == 0

    def refuse(*args, **kwargs):
        raise AssertionError("a cached apply built the model")

    monkeypatch.setattr(apply_library, "meta_model", refuse)
    capsys.readouterr()
    assert main(["apply", str(PLANS / "auto-ep2.yaml"), str(tiny_dir), "--out", str(out), "--report", str(second)]) == 0
    assert "current, reused" in capsys.readouterr().out
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert a["modules"] == b["modules"] and a["generated"] == b["generated"]


def test_quantised_checkpoints_from_make_tiny_to_a_verified_run(tmp_path: Path, capsys) -> None:
    """make-tiny --quantize writes the Hub's layout; describe-moe and apply say how it is read; apply
    --nproc 2 --verify runs it dequantised on two ranks against plain transformers' load."""
    ckpt = tmp_path / "gpt_oss-mxfp4"
    assert main(["make-tiny", "gpt_oss", str(ckpt), "--quantize", "mxfp4"]) == 0
    config = json.loads((ckpt / "config.json").read_text())
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert config["quantization_config"]["quant_method"] == "mxfp4" and config["dtype"] == "bfloat16"
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in index and len(set(index.values())) == 2
    capsys.readouterr()
    assert main(["describe-moe", str(ckpt)]) == 0
    assert "MXFP4 (E2M1 codes, one scale per 32 values), dequantised at load to bfloat16" in capsys.readouterr().out
    report = tmp_path / "report.json"
    assert main(["apply", str(PLANS / "auto-ep2.yaml"), str(ckpt), "--out", str(tmp_path / "gen"), "--nproc", "2",
                 "--verify", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["checkpoint"].startswith("MXFP4") and data["verify"]["passed"]
    assert data["verify"]["logits_max_rel"] <= 1e-5 and data["verify"]["grad_max_rel"] <= 1e-5
    assert main(["make-tiny", "mixtral", str(tmp_path / "no"), "--quantize", "mxfp4"]) == 2
    assert "the MXFP4 Hub layout is gpt-oss's" in capsys.readouterr().out and not (tmp_path / "no").exists()


def test_apply_verifies_a_checkpoint_that_lacks_experts(tiny_dir: Path, tmp_path: Path) -> None:
    """A checkpoint without layer 1's experts (a new layer, a pruned one): apply --nproc 2 --verify loads it as
    from_pretrained does, the missing experts drawn as plain transformers draws them, each rank its rows, and
    the run equals the unmodified model loaded the same way (#56)."""
    from tests.missing_experts_cases import _without

    lacking = _without(tiny_dir, tmp_path / "lacking", lambda k: ".layers.1.mlp.experts." in k)
    report = tmp_path / "report.json"
    assert main(["apply", str(PLANS / "auto-ep2.yaml"), str(lacking), "--out", str(tmp_path / "gen"), "--nproc", "2",
                 "--verify", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["verify"]["passed"] and data["verify"]["grad_max_rel"] <= 1e-5, data["verify"]


def test_unsupported_quantisation_is_refused_by_every_command(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    import shutil

    gptq = tmp_path / "gptq"
    shutil.copytree(tiny_dir, gptq)
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (gptq / "config.json").write_text(json.dumps(config))
    for argv in (["describe-moe", str(gptq)], ["apply", str(PLANS / "auto-ep2.yaml"), str(gptq), "--out",
                 str(tmp_path / "gen")], ["cost", str(PLANS / "auto-ep2.yaml"), str(gptq), "--seq-len", "8",
                 "--micro-batch", "1"]):
        assert main(argv) == 2, argv
        out = capsys.readouterr().out
        assert "quantised with GPTQ" in out and "dequantize it once with plain transformers" in out, out
        assert "Traceback" not in out
    assert not (tmp_path / "gen").exists()


def test_apply_tp_plan_nproc4_verify(tmp_path: Path) -> None:
    """plans/tp2-sp-ep4.yaml on DeepSeek-V3 (MLA attention, a shared expert, a dense first layer): the
    TP x SP x EP model on 4 ranks against the unmodified model, logits and every gradient."""
    model_dir = make_tiny("deepseek_v3", tmp_path / "deepseek_v3")
    report = tmp_path / "report.json"
    assert main(["apply", str(PLANS / "tp2-sp-ep4.yaml"), str(model_dir), "--out", str(tmp_path / "gen"),
                 "--nproc", "4", "--verify", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["verify"]["passed"] and data["verify"]["grad_max_rel"] <= 1e-5
    tp = [r["tensor_parallel"] for r in data["ranks"]]
    assert all(t["tp_size"] == 2 and t["sequence_parallel"] and t["split_modules"] > 0 for t in tp)


def test_apply_context_plan_verify(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    """A cp_size 2 plan (plans/cp2-ep4.yaml's, at EP 2 on 2 ranks: tests/test_context.py runs the 4-rank
    worlds) against the unmodified model, logits and every gradient; a cp_size the heads refuse is a clean
    error."""
    plan = tmp_path / "cp2.yaml"
    plan.write_text((PLANS / "cp2-ep4.yaml").read_text().replace("ep_size: 4", "ep_size: 2"))
    report = tmp_path / "report.json"
    assert main(["apply", str(plan), str(tiny_dir), "--out", str(tmp_path / "gen"),
                 "--nproc", "2", "--verify", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["verify"]["passed"] and data["verify"]["grad_max_rel"] <= 1e-5
    assert all(r["context_parallel"]["cp_size"] == 2 and r["context_parallel"]["attention_modules"] > 0
               for r in data["ranks"])
    capsys.readouterr()
    plan.write_text("version: 1\nep_size: 1\ncp_size: 3\n")
    out = tmp_path / "gen3"
    assert main(["apply", str(plan), str(tiny_dir), "--out", str(out), "--nproc", "3"]) == 2
    err = capsys.readouterr().out
    assert "cp_size 3 does not divide" in err and "attention heads" in err and "Traceback" not in err
    assert not out.exists()


def test_tp_that_does_not_fit_the_model_is_a_clean_error(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    plan = tmp_path / "tp4.yaml"
    plan.write_text("version: 1\nep_size: 4\ntp_size: 4\n")  # the tiny qwen3_moe has 2 key/value heads
    out = tmp_path / "gen"
    assert main(["apply", str(plan), str(tiny_dir), "--out", str(out), "--nproc", "4"]) == 2
    err = capsys.readouterr().out
    assert "num_key_value_heads=2" in err and "tp_size" in err and "Traceback" not in err
    assert not out.exists()
    plan.write_text("version: 1\nep_size: 1\ntp_size: 2\n")
    assert main(["apply", str(plan), str(tiny_dir), "--out", str(out), "--nproc", "3"]) == 2
    assert "tp_size 2" in capsys.readouterr().out
