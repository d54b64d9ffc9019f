"""The rewriter end to end: matching, generated code, artifacts, and whole-model parity."""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hp_rewrite.codegen.artifacts import MANIFEST_FILE, MODULE_FILE
from hp_rewrite.errors import SelectionError
from hp_rewrite.launch import run_world
from hp_rewrite.rewrite import generate, install
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.group.groups import ExpertParallelGroup
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests.rewrite_cases import REQUIRED_FAMILIES, TOL, compare, plan_for


@pytest.mark.parametrize("model_type", REQUIRED_FAMILIES)
def test_ep1_whole_model_matches_unmodified(model_type: str, tmp_path: Path) -> None:
    r = compare(model_type, str(tmp_path))
    assert r["patched"], f"{model_type}: no MoE block patched ({r['unmatched']})"
    assert r["worst_err"] <= TOL, f"{model_type}: {r['worst']} relative error {r['worst_err']:.2e}"


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_output_router_logits_keeps_working(model_type: str, tmp_path: Path) -> None:
    r = compare(model_type, str(tmp_path), router_logits=True)
    assert r["errors"]["aux_loss"] <= TOL and r["worst_err"] <= TOL, r


def test_chunked_eager_sync_plan_matches_unmodified(tmp_path: Path) -> None:
    r = compare("qwen2_moe", str(tmp_path), chunks=2, compute="eager", overlap=False)
    assert r["worst_err"] <= TOL, r


@pytest.mark.parametrize(("model_type", "router"), [("qwen3_moe", "softmax_topk"), ("deepseek_v3", "sigmoid_group")])
def test_inlined_router_matches_unmodified(model_type: str, router: str, tmp_path: Path) -> None:
    r = compare(model_type, str(tmp_path), archetype={"router": router})
    assert r["patched"] and {a["router"] for a in r["archetypes"]} == {router}, r
    assert r["worst_err"] <= TOL, f"{model_type}: {r['worst']} relative error {r['worst_err']:.2e}"


def test_forced_router_that_does_not_fit_is_refused_with_the_reason(tmp_path: Path) -> None:
    """No block fits the forced router: nothing would be expert-parallel, so it is an error (#23 item 1)."""
    with pytest.raises(SelectionError, match=r"mlp \(Qwen3MoeSparseMoeBlock\): unmatched: the plan asks for router: sigmoid_group"):
        compare("qwen3_moe", str(tmp_path), archetype={"router": "sigmoid_group"})


# Experts that take no routing (Llama 4): the router score scales the experts' input (input_scaled archetype).
INPUT_SCALED_FAMILIES = ["llama4_text", "llama4"]


@pytest.mark.parametrize("model_type", INPUT_SCALED_FAMILIES)
def test_input_scaled_routing_matches_unmodified(model_type: str, tmp_path: Path) -> None:
    r = compare(model_type, str(tmp_path))
    assert len(r["patched"]) == 2 and {a["router"] for a in r["archetypes"]} == {"input_scaled"}, r
    assert {a["level"] for a in r["archetypes"]} == {"block"}, r
    assert r["worst_err"] <= TOL, f"{model_type}: {r['worst']} relative error {r['worst_err']:.2e}"


def test_input_scaled_router_logits_keep_working(tmp_path: Path) -> None:
    """Llama 4 records its router logits (no aux loss in transformers): the rewritten model gives the same."""
    ref = build_tiny_model(tiny_config("llama4_text"), seed=0)
    model = copy.deepcopy(ref)
    plan = plan_for(1)
    _, artifact = generate(model, plan, model.config, tmp_path)
    assert install(model, artifact, plan, ExpertParallelGroup.single())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(input_ids=ids, output_router_logits=True), model(input_ids=ids, output_router_logits=True)
    assert a.router_logits and len(a.router_logits) == len(b.router_logits)
    for x, y in zip(a.router_logits, b.router_logits, strict=True):
        assert x.shape == y.shape and ((x - y).abs().max() / x.abs().max()).item() <= TOL
    assert getattr(b, "aux_loss", None) is None and getattr(a, "aux_loss", None) is None


def test_forced_router_is_not_ignored_for_input_scaled_blocks(tmp_path: Path) -> None:
    with pytest.raises(SelectionError, match="unmatched: the plan asks for router: softmax_topk"):
        compare("llama4_text", str(tmp_path), archetype={"router": "softmax_topk"})


# Zero-computation (identity) experts (LongCat-Flash): ids >= the routed-expert count give w * x, taken
# on the sending rank and never dispatched; the gate_up_proj rows they never read stay on every rank.
ZERO_EXPERT_FAMILIES = ["longcat_flash"]


@pytest.mark.parametrize("model_type", ZERO_EXPERT_FAMILIES)
def test_zero_experts_match_unmodified(model_type: str, tmp_path: Path) -> None:
    from tests.test_zero_experts import longcat_holds_zero_experts

    r = compare(model_type, str(tmp_path))
    layout = "fused-zero-experts" if longcat_holds_zero_experts() else "fused"  # transformers 5.25: in the block
    assert len(r["patched"]) == 2 and {a["layout"] for a in r["archetypes"]} == {layout}, r
    assert r["worst_err"] <= TOL, f"{model_type}: {r['worst']} relative error {r['worst_err']:.2e}"


_EP2_CASES = [{"name": t, "model_type": t} for t in REQUIRED_FAMILIES + INPUT_SCALED_FAMILIES + ZERO_EXPERT_FAMILIES]
_EP2_CASES.append({"name": "qwen3_moe-chunks2", "model_type": "qwen3_moe", "runtime": {"chunks": 2}})
_BALANCE = {"balance": "auto", "balance_threshold": 1.0, "balance_min_rows": 1}  # forced on: any move pays
_EP2_CASES += [{"name": f"{t}-balanced", "model_type": t, "runtime": {**_BALANCE, **extra}}  # runtime.balance
               for t, extra in [("qwen3_moe", {"chunks": 2}), ("deepseek_v3", {}), ("gpt_oss", {"dedup": False}),
                                ("llama4_text", {}), ("longcat_flash", {})]]


_HOST_TRAFFIC_CASES = [{"name": f"{t}-chunks{c}", "model_type": t, "runtime": {"chunks": c}}
                       for t in ("qwen3_moe", "deepseek_v3") for c in (1, 2)]
_HOST_TRAFFIC_CASES += [{"name": f"{t}-balanced", "model_type": t, "runtime": {**_BALANCE, "chunks": 2}}
                        for t in ("qwen3_moe", "deepseek_v3")]


@pytest.fixture(scope="module")
def ep2_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ep2")
    return run_world(2, "tests.rewrite_cases:run_world_cases", {"out_dir": str(out), "cases": _EP2_CASES,
                                                               "host_traffic": _HOST_TRAFFIC_CASES})


@pytest.mark.parametrize("case", [c["name"] for c in _HOST_TRAFFIC_CASES])
def test_ep2_layer_reads_the_host_once_and_uploads_nothing(case: str, ep2_results: list[dict]) -> None:
    """On a GPU each read of a device value stalls the host until the stream drains, and each tensor built
    from Python data is a blocking copy: per MoE layer one read (the split sizes), in the forward only,
    after the shared expert was queued; no upload."""
    for rank, results in enumerate(ep2_results):
        r = results[f"host-{case}"]
        assert len(r["forward"]) == r["layers"] > 0, r
        for layer in r["forward"]:
            assert len(layer["reads"]) == 1 and not layer["uploads"], (rank, layer)
            assert layer["shared_first"], (rank, layer)
        assert not r["backward_reads"] and not r["backward_uploads"], (rank, r)
        if case.startswith("deepseek_v3"):  # its MoE layers have a shared expert
            assert all(layer["has_shared"] for layer in r["forward"]), (rank, r)


@pytest.mark.parametrize("case", [c["name"] for c in _EP2_CASES])
def test_ep2_whole_model_matches_unmodified(case: str, ep2_results: list[dict]) -> None:
    for rank, results in enumerate(ep2_results):
        r = results[case]
        assert r["patched"], r
        assert r["worst_err"] <= TOL, f"rank {rank}: {r['worst']} relative error {r['worst_err']:.2e}"
    if case.endswith("-balanced"):  # forced on: some layer computed another rank's rows
        assert sum(results[case]["guests"] for results in ep2_results) > 0


# ---------------------------------------------------------------------------------------------- codegen
@pytest.fixture(scope="module")
def qwen2_model():
    return build_tiny_model(tiny_config("qwen2_moe"), seed=0)


def test_generated_code_is_deterministic_lint_clean_and_current(qwen2_model, tmp_path: Path) -> None:
    plan = plan_for(2)
    _, a1 = generate(qwen2_model, plan, qwen2_model.config, tmp_path / "a")
    _, a2 = generate(qwen2_model, plan, qwen2_model.config, tmp_path / "b")
    assert a1.directory.name == a2.directory.name
    for f in (MODULE_FILE, MANIFEST_FILE, "changes.diff"):
        assert (a1.directory / f).read_bytes() == (a2.directory / f).read_bytes(), f
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", str(a1.module_path)],
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    manifest = json.loads((a1.directory / MANIFEST_FILE).read_text())
    assert manifest["plan_hash"] == plan.hash() and "Qwen2MoeSparseMoeBlock" in " ".join(manifest["classes"])
    # current artifact: reused as is
    mtime = a1.module_path.stat().st_mtime_ns
    _, again = generate(qwen2_model, plan, qwen2_model.config, tmp_path / "a")
    assert again.module_path.stat().st_mtime_ns == mtime
    # a different plan selects a different artifact
    _, other = generate(qwen2_model, plan_for(2, chunks=2), qwen2_model.config, tmp_path / "a")
    assert other.directory != a1.directory


def test_tampered_artifact_is_regenerated(qwen2_model, tmp_path: Path) -> None:
    plan = plan_for(1)
    _, art = generate(qwen2_model, plan, qwen2_model.config, tmp_path)
    good = art.module_path.read_text()
    art.module_path.write_text(good.replace("hp.dispatch(", "hp.dispatch_tampered("))
    _, again = generate(qwen2_model, plan, qwen2_model.config, tmp_path)
    assert again.module_path.read_text() == good
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left behind"


def test_installed_forward_points_at_the_generated_file(qwen2_model, tmp_path: Path) -> None:
    import copy

    model = copy.deepcopy(qwen2_model)
    plan = plan_for(1)
    _, art = generate(model, plan, model.config, tmp_path)
    install(model, art, plan, ExpertParallelGroup.single())
    block = model.model.layers[0].mlp
    assert inspect.getsourcefile(block.forward) == str(art.module_path)
    assert "hp.dispatch(" in inspect.getsource(block.forward)
    assert installed.original_forward(block).__func__ is type(block).forward  # the original stays reachable
    with torch.no_grad():
        x = torch.randn(1, 3, model.config.hidden_size)
        torch.testing.assert_close(block(x), installed.original_forward(block)(x), rtol=1e-5, atol=1e-6)


def test_plan_level_experts_keeps_block_code(qwen2_model, tmp_path: Path) -> None:
    from hp_rewrite.plan import parse_plan

    plan = parse_plan("version: 1\nep_size: 1\narchetype:\n  level: experts\n")
    analysis, art = generate(qwen2_model, plan, qwen2_model.config, tmp_path)
    assert {r.archetype.level for r in analysis.matched} == {"experts"}
    assert "Qwen2MoeSparseMoeBlock" not in art.module_path.read_text()


def test_interrupted_generation_leaves_nothing(qwen2_model, tmp_path: Path, monkeypatch) -> None:
    from hp_rewrite.codegen import artifacts

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts, "_diff", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate(qwen2_model, plan_for(1), qwen2_model.config, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_ensure_artifact_reuses_without_analysis(qwen2_model, tmp_path: Path, monkeypatch) -> None:
    from hp_rewrite.match import generate as rewrite

    plan = plan_for(2)
    first = rewrite.ensure_artifact(qwen2_model, plan, qwen2_model.config, tmp_path)

    def no_analysis(*_):
        raise AssertionError("a current artifact must be reused without re-running the analysis")

    monkeypatch.setattr(rewrite, "analyze", no_analysis)
    assert rewrite.ensure_artifact(qwen2_model, plan, qwen2_model.config, tmp_path).directory == first.directory
    first.module_path.write_text(first.module_path.read_text() + "\n# edited\n")  # tampered: not reused
    with pytest.raises(AssertionError, match="re-running the analysis"):
        rewrite.ensure_artifact(qwen2_model, plan, qwen2_model.config, tmp_path)


def test_lora_on_flat_expert_weights_is_refused_and_on_zero_expert_weights_matches(tmp_path: Path) -> None:
    """PEFT target_parameters: DBRX's flat weights live in a child whose forward the expert-parallel
    holder never calls, so an adapter there would be skipped: refused, naming it. LongCat-Flash's 3-D
    weights are read through the wrapped holder: the adapter applies, as in the unmodified model."""
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for model_type, targets in (("dbrx", ["mlp.w1"]), ("longcat_flash", ["mlp.experts.gate_up_proj"])):
        ref = build_tiny_model(tiny_config(model_type), seed=0)
        model, plan = copy.deepcopy(ref), plan_for(1)
        _, artifact = generate(model, plan, model.config, tmp_path / model_type)
        assert install(model, artifact, plan, ExpertParallelGroup.single())
        adapters = []
        for m in (ref, model):
            torch.manual_seed(3)
            adapters.append(get_peft_model(m, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                                                         target_parameters=targets)))
        if model_type == "dbrx":
            with pytest.raises(ExpertParallelError, match="would skip the adapter"):
                adapters[1](input_ids=ids)
            continue
        with torch.no_grad():
            want, got = (a(input_ids=ids).logits for a in adapters)
            plain = build_tiny_model(tiny_config(model_type), seed=0)(input_ids=ids).logits
        assert not torch.allclose(want, plain)  # the adapter changes the output
        assert ((got - want).abs().max() / want.abs().max()).item() <= TOL


def _two_worlds_at_once(tmp_path: Path, model_dir: Path, artifact_dir: Path, round_name: str) -> list[list[dict]]:
    """Two 2-rank worlds started together, loading ``model_dir`` into the one ``artifact_dir``."""
    from concurrent.futures import ThreadPoolExecutor

    gate = tmp_path / f"gate-{round_name}"
    gate.mkdir()
    payload = {"model_dir": str(model_dir), "artifact_dir": str(artifact_dir), "gate": str(gate), "ranks": 4}
    with ThreadPoolExecutor(2) as pool:
        worlds = [pool.submit(run_world, 2, "tests.rewrite_cases:load_beside_another_world",
                              {**payload, "world_id": w}, timeout=300) for w in range(2)]
        return [w.result() for w in worlds]


def test_two_worlds_load_one_model_into_one_artifact_directory_at_once(tmp_path: Path) -> None:
    """Two jobs at once on one machine (two torchrun jobs, CI beside a developer, every node's rank 0 on a
    shared home directory) load one checkpoint into one artifact cache: both rank 0s write the same artifact
    at the same moment, then both replace it once it went stale (its generated file edited); every rank of
    both loads, and the cache ends with the one artifact and nothing else."""
    from hp_rewrite.tiny import make_tiny

    model_dir = make_tiny("qwen3_moe", tmp_path / "m")
    cache = tmp_path / "cache"
    for round_name in ("empty", "stale"):
        worlds = _two_worlds_at_once(tmp_path, model_dir, cache, round_name)
        for world in worlds:  # one program twice on the same inputs: the same logits
            for rank, r in enumerate(world):
                torch.testing.assert_close(r["logits"], worlds[0][rank]["logits"], rtol=0, atol=0)
        artifacts = sorted(p.name for p in cache.iterdir())
        assert len(artifacts) == 1 and artifacts[0].startswith("qwen3_moe-"), artifacts
        module = cache / artifacts[0] / MODULE_FILE
        assert "edited by hand" not in module.read_text()
        if round_name == "empty":
            module.write_text(module.read_text() + "\n# edited by hand: no longer what the manifest recorded\n")
