"""Remote-code MoE models whose experts are an ``nn.ModuleList`` of per-expert MLPs, with the routing
written inline in the block's forward (#23 items 2, 3, 5): softmax top-k with renormalisation, softmax
top-k with a gated shared expert, and a grouped sigmoid router (correction bias on the block) with an
additive shared expert. At EP=1 and EP=2 against the unmodified remote model: logits and every
gradient (fp32, 1e-5), each rank keeping and reading only its experts' modules under their original
names, and a save that plain transformers (with the remote code) loads back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

import hp_rewrite
from hp_rewrite.launch import run_world
from hp_rewrite.plan import Plan

from .remote_code import write_checkpoint

SHAPES = ("softmax", "softmax_gated_shared", "sigmoid_group")
TOL = 1e-5
EP1 = Plan.model_validate({"version": 1, "ep_size": 1})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("remote")
    dirs = {r: write_checkpoint(root / r, router=r, seed=i) for i, r in enumerate(SHAPES)}
    for d in dirs.values():  # the remote code in transformers' module cache before ranks import it at once
        transformers.AutoConfig.from_pretrained(d, trust_remote_code=True)
    return dirs


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


@pytest.mark.parametrize("shape", SHAPES)
def test_ep1_matches_the_remote_model(shape, checkpoints, tmp_path) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[shape], trust_remote_code=True)
    with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        ours = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[shape], trust_remote_code=True)
    assert type(ours) is type(ref) and ours.hp_rewrite.patched == ["model.layers.0.mlp", "model.layers.1.mlp"]
    block = ours.model.layers[0].mlp
    assert block.forward.__func__.__name__ == "TinyMoeSparseBlock_forward"
    assert isinstance(block.experts, torch.nn.ModuleList) and len(block.experts) == 4
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    a, b = ref(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    assert ((a.logits - b.logits).abs().max() / a.logits.abs().max()).item() <= TOL
    theirs = dict(ref.named_parameters())
    assert set(theirs) == {n for n, _ in ours.named_parameters()}
    for n, p in ours.named_parameters():
        want = _grad(theirs[n])
        assert ((_grad(p) - want).abs().max() / want.abs().max().clamp_min(1e-6)).item() <= TOL, n


def test_ep2_local_expert_modules_gradients_and_save(checkpoints, tmp_path) -> None:
    payload = {"checkpoints": {k: str(v) for k, v in checkpoints.items()}, "gen_dir": str(tmp_path / "gen"),
               "save_dir": str(tmp_path / "saved")}
    ranks = run_world(2, "tests.remote_cases:ep2_remote", payload, timeout=400)
    for shape in SHAPES:
        r0, r1 = ranks[0][shape], ranks[1][shape]
        assert (r0["held"], r1["held"]) == (["0", "1"], ["2", "3"])  # original keys, this rank's experts only
        for r in (r0, r1):
            assert r["experts_type"] == "ExpertModuleList" and r["names_subset"]  # a ModuleList with a forward (FSDP2)
            assert r["logits_rel"] <= TOL, (shape, r)
            assert r["grad_worst"] <= TOL, (shape, r["grad_worst_name"], r["grad_worst"])
            assert r["bytes_read"] == r["local_bytes"]  # only this rank's experts (and the rest) were read
        # the save holds every expert under the remote code's names; plain transformers loads it back
        saved = tmp_path / "saved" / shape
        assert (saved / "modeling_tiny_moe.py").is_file()
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True)
        original = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[shape], trust_remote_code=True)
        with safe_open(saved / "model.safetensors", "pt") as f, safe_open(
                checkpoints[shape] / "model.safetensors", "pt") as g:
            assert sorted(f.keys()) == sorted(g.keys())
        for (n, a), (m, b) in zip(reloaded.state_dict().items(), original.state_dict().items(), strict=True):
            assert n == m and torch.equal(a, b), n
    for r in ranks:  # hp_rewrite.fully_shard: the expert-module container is an FSDP2 unit over the replicas
        assert r["fsdp"]["sharded"] and r["fsdp"]["grad_worst"] <= TOL, r["fsdp"]


def test_cli_needs_and_takes_trust_remote_code(checkpoints, tmp_path, capsys) -> None:
    """describe-moe, apply (--nproc 1 --verify), cost and profile read a remote-code checkpoint only with
    --trust-remote-code; without it, exit 2 naming the code files and the flag."""
    from hp_rewrite.cli import main

    model = str(checkpoints["softmax_gated_shared"])
    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nep_size: 1\n")
    capsys.readouterr()
    assert main(["describe-moe", model]) == 2
    out = capsys.readouterr().out
    assert "remote-code model" in out and "modeling_tiny_moe.py" in out and "--trust-remote-code" in out
    assert "Traceback" not in out
    assert main(["describe-moe", model, "--trust-remote-code"]) == 0
    out = capsys.readouterr().out
    assert "layout modules-gated, 4 experts" in out and "router: gate (Linear)" in out
    assert "expert modules: 4 x TinyMoeMLP: gate w1, up w3, down w2, activation silu" in out
    gen = tmp_path / "gen"
    assert main(["apply", str(plan), model, "--out", str(gen), "--trust-remote-code", "--nproc", "1",
                 "--verify"]) == 0
    assert "verify: PASS" in capsys.readouterr().out
    assert main(["cost", str(plan), model, "--seq-len", "32", "--micro-batch", "2", "--trust-remote-code",
                 "--json"]) == 0
    capsys.readouterr()
    assert main(["profile", str(plan), model, "--trust-remote-code", "--out", str(tmp_path / "prof"),
                 "--seq-len", "8", "--batch", "2"]) == 0
    import json

    layers = json.loads((tmp_path / "prof" / "profile.json").read_text())["layers"]
    assert [sum(layer["tokens_per_expert"]) for layer in layers] == [2 * 8 * 2] * 2  # top-2 of 16 tokens


def test_artifact_hash_covers_the_remote_code(checkpoints, tmp_path) -> None:
    """An edit to any of the remote code's files selects a new artifact (the manifest hashes them)."""
    import shutil

    from hp_rewrite.apply import generate_artifact
    from hp_rewrite.hf import load_config

    model = tmp_path / "model"
    shutil.copytree(checkpoints["softmax"], model)
    first = generate_artifact(EP1, load_config(model, trust_remote_code=True), model, tmp_path / "gen")
    assert first.artifact.manifest["remote_code_sha256"]
    again = generate_artifact(EP1, load_config(model, trust_remote_code=True), model, tmp_path / "gen")
    assert again.cached and again.artifact.directory == first.artifact.directory
    with open(model / "configuration_tiny_moe.py", "a") as f:
        f.write("\n# an edit\n")
    edited = generate_artifact(EP1, load_config(model, trust_remote_code=True), model, tmp_path / "gen")
    assert not edited.cached and edited.artifact.directory != first.artifact.directory
