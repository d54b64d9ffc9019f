"""Training-step equivalence under EP and EP x DP, gradient scale included, and auto-patch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import hp_rewrite
from hp_rewrite.launch import run_world
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.tiny import make_tiny
from tests.training_cases import TOL

CASES = [  # (world, ep_size, model_type, aux, balanced placement)
    (2, 2, "qwen3_moe", False, False),
    (2, 2, "mixtral", True, False),
    (4, 2, "qwen2_moe", False, False),  # EP=2 x data parallel 2
    (4, 2, "qwen2_moe", False, True),  # the same with the experts spread by the plan's placement
    (4, 4, "deepseek_v3", False, False),
]


@pytest.mark.parametrize(("world", "ep_size", "model_type", "aux", "balanced"), CASES,
                         ids=[f"world{w}-ep{e}-{m}" + ("-balanced" if b else "") for w, e, m, _, b in CASES])
def test_one_adamw_step_equals_unmodified(world, ep_size, model_type, aux, balanced, tmp_path: Path) -> None:
    payload = {"ep_size": ep_size, "model_type": model_type, "aux": aux, "out_dir": str(tmp_path),
               "balanced": balanced, "plan": "runtime:\n  grad_bucket_mb: 0.004\n"}  # 4 KiB: many buckets
    for rank, r in enumerate(run_world(world, "tests.training_cases:training_step", payload)):
        # sync_gradients holds one bucket's copy at a time (experts without replicas: none at all)
        assert r["expert_grad_bytes"] > 4 * r["bucket_bytes"] and r["dense_grad_bytes"] > 4 * r["bucket_bytes"], r
        assert 0 < r["sync_peak"] <= r["bucket_bytes"] and r["clip_peak"] <= r["bucket_bytes"], r
        assert r["grad_worst"] <= TOL, f"rank {rank}: gradient of {r['grad_worst_name']} off by {r['grad_worst']:.2e}"
        assert r["worst"] <= TOL, f"rank {rank}: {r['worst_name']} differs by {r['worst']:.2e} after one step"
        assert all(n * ep_size == r["local_experts"][0] * ep_size for n in r["local_experts"])
        assert set(r["contiguous"]) == {not balanced}
        if aux:
            assert r["aux_rel"] <= TOL, r


DEFER = "runtime:\n  defer_expert_grads: true\n"


@pytest.mark.parametrize(("world", "ep_size", "model_type"), [(2, 2, "qwen3_moe"), (4, 2, "qwen2_moe")],
                         ids=["world2-ep2-qwen3_moe", "world4-ep2-qwen2_moe"])
def test_one_adamw_step_with_deferred_expert_grads(world, ep_size, model_type, tmp_path: Path) -> None:
    """runtime.defer_expert_grads: the expert weight gradients, computed in the backward's exchange waits
    and at its end, give the same step as the unmodified model (EP=2, and EP=2 x data parallel 2)."""
    payload = {"ep_size": ep_size, "model_type": model_type, "aux": False, "out_dir": str(tmp_path),
               "plan": DEFER}
    results = run_world(world, "tests.training_cases:training_step", payload)
    for rank, r in enumerate(results):
        assert r["grad_worst"] <= TOL, f"rank {rank}: gradient of {r['grad_worst_name']} off by {r['grad_worst']:.2e}"
        assert r["worst"] <= TOL, f"rank {rank}: {r['worst_name']} differs by {r['worst']:.2e} after one step"
        assert r["deferred_jobs"] > 0 and r["deferred_left"] == 0, r
    # the first wait of each backward exchange finds the peer's rows still in flight: jobs ran there
    assert any(r["deferred_in_waits"] > 0 for r in results), results


def test_deferred_expert_grads_refuse_hooks_and_create_graph(tmp_path: Path) -> None:
    for r in run_world(2, "tests.training_cases:deferred_refusals", {"out_dir": str(tmp_path)}):
        assert "defer_expert_grads" in r.get("hooked", "") and "gradient hooks" in r["hooked"], r
        assert "Qwen3MoeExperts.gate_up_proj" in r["hooked"], r  # names the weight
        assert "create_graph" in r.get("create_graph", ""), r


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "m")


def test_auto_patch_context_manager_single_process(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager")
    plan = hp_rewrite.loading.patch.resolve_plan(Path(__file__).parent.parent / "plans" / "auto-ep2.yaml")
    # no launcher, asked for one process in so many words: EP=1, the same generated code, and a warning
    with CaptureLogger(hf_logging.get_logger("transformers.hp_rewrite")) as log, \
            hp_rewrite.auto_patch(plan, artifact_dir=tmp_path, single_process=True):
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager")
    assert "single_process=True: the plan's ep_size=2 is not applied" in log.out and "not expert-parallel" in log.out
    assert PreTrainedModel.__dict__["from_pretrained"] is original
    assert model.hp_rewrite.ep.size == 1 and model.hp_rewrite.patched
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_auto_patch_reads_plan_from_environment(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    plan = Path(__file__).parent.parent / "plans" / "auto-ep2.yaml"
    monkeypatch.setenv("HP_REWRITE_PLAN", str(plan))
    handle = hp_rewrite.auto_patch(artifact_dir=tmp_path, single_process=True)
    try:
        from transformers import Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM.from_pretrained(tiny_dir)
        assert model.hp_rewrite.plan.ep_size == 2 and model.hp_rewrite.ep.size == 1
    finally:
        handle.remove()


@pytest.mark.parametrize("how", ["from_pretrained", "auto_patch", "ep4"])
def test_parallel_plan_without_a_launcher_is_refused(how: str, tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """No torchrun, no process group: a plan with ep_size > 1 is refused, saying how to launch, never a model
    that holds every expert on every rank while the plan says expert-parallel; nothing is written."""
    from transformers import AutoModelForCausalLM

    for variable in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    plans = Path(__file__).parent.parent / "plans"
    plan = plans / ("auto-ep4.yaml" if how == "ep4" else "auto-ep2.yaml")
    with pytest.raises(ExpertParallelError) as refused:
        if how == "auto_patch":
            with hp_rewrite.auto_patch(plan, artifact_dir=tmp_path / "art"):
                AutoModelForCausalLM.from_pretrained(tiny_dir)
        else:
            hp_rewrite.from_pretrained(tiny_dir, plan=plan, artifact_dir=tmp_path / "art")
    size = 4 if how == "ep4" else 2
    assert f"ep_size={size}" in str(refused.value) and "torchrun --nproc-per-node N" in str(refused.value)
    assert "single_process=True" in str(refused.value) and not (tmp_path / "art").exists()


def test_load_logs_what_each_rank_holds(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    """One line at load through transformers' logger: the blocks, the EP size and the experts held, TP, the
    plan's hash (INFO on rank 0; the torchrun example prints it on every rank: test_engines); the weights
    read under transformers' progress bar, as plain transformers shows it."""
    plan = hp_rewrite.loading.patch.resolve_plan(Path(__file__).parent.parent / "plans" / "auto-ep2.yaml")
    hf_logging.set_verbosity_info()
    try:
        with CaptureLogger(hf_logging.get_logger("transformers.hp_rewrite")) as log:
            model = hp_rewrite.from_pretrained(tiny_dir, plan=plan, artifact_dir=tmp_path, single_process=True)
    finally:
        hf_logging.set_verbosity_warning()
    want = (f"hp-rewrite: 2 MoE block(s) expert-parallel, EP 1 (rank 0 of its EP group holds 8 of 8 experts per "
            f"block), TP 1, plan {plan.hash()[:12]}")
    assert model.hp_rewrite.summary == want and want in log.out
    assert "Loading weights" in capsys.readouterr().err


def test_auto_patch_without_plan_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.delenv("HP_REWRITE_PLAN", raising=False)
    with pytest.raises(ExpertParallelError, match="HP_REWRITE_PLAN"):
        hp_rewrite.auto_patch()


def test_auto_patch_in_a_world_of_two(tiny_dir: Path, tmp_path: Path) -> None:
    results = run_world(2, "tests.training_cases:auto_patch_world", {"model_dir": str(tiny_dir),
                                                                      "out_dir": str(tmp_path)})
    for r in results:
        assert r["err"] <= 1e-5 and r["local"] and all(n == r["local"][0] for n in r["local"])
        assert not r["after_patched"], "the patch must be gone after the with block"


def test_from_pretrained_one_call(tiny_dir: Path, tmp_path: Path) -> None:
    model = hp_rewrite.from_pretrained(tiny_dir, plan=hp_rewrite.loading.patch.resolve_plan(
        Path(__file__).parent.parent / "plans" / "auto-ep4.yaml"), artifact_dir=tmp_path, single_process=True)
    assert model.hp_rewrite.ep.size == 1 and os.path.isdir(model.hp_rewrite.artifact_dir)


@pytest.mark.parametrize(("world", "ep_size", "plan"), [(2, 2, ""), (4, 2, ""), (4, 2, DEFER)],
                         ids=["ep2", "ep2xdp2", "ep2xdp2-deferred-expert-grads"])
def test_gradient_sync_during_backward_equals_after(world: int, ep_size: int, plan: str, tmp_path: Path) -> None:
    """With deferred expert gradients (no hooks see them) their buckets start in wait(); still equal to
    sync_gradients after a backward without deferral."""
    payload = {"model_type": "qwen2_moe", "ep_size": ep_size, "out_dir": str(tmp_path), "plan": plan}
    for rank, r in enumerate(run_world(world, "tests.training_cases:overlapped_sync", payload)):
        assert r["worst"] <= 1e-6, (rank, r)
        # buckets started while backward was still running: the all-reduce overlapped it
        assert r["buckets"] > 2 and all(0 < n <= r["buckets"] for n in r["overlapped"]), (rank, r)
        assert "wait()" in r["refused"] and "no_sync" in r["refused"], (rank, r)


def test_gradient_sync_single_process_and_errors(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager")
    with pytest.raises(ValueError, match="not rewritten by hp-rewrite"):
        hp_rewrite.gradient_sync(plain)
    model = hp_rewrite.from_pretrained(tiny_dir, plan=Path(__file__).parent.parent / "plans" / "auto-ep2.yaml",
                                       artifact_dir=tmp_path, attn_implementation="eager", single_process=True)
    sync = hp_rewrite.gradient_sync(model)  # no world: nothing to reduce, gradients stay as they are
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    sync.wait()
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert not sync.enabled and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize(
    ("world", "ep_size", "plan"),
    [
        (2, 2, ""),
        (2, 2, "runtime: {dedup: false, overlap: false}\n"),  # the synchronous exchanges take turns too
        (2, 2, "runtime: {chunks: 2}\n"),
        (4, 2, ""),  # EP=2 x DP=2
        (2, 2, DEFER),  # one micro-batch's weight-gradient jobs may run in the other's waits
    ],
    ids=["ep2", "ep2-plain-sync", "ep2-chunks2", "ep2xdp2", "ep2-deferred-expert-grads"],
)
def test_interleaved_micro_batches_equal_unmodified(world: int, ep_size: int, plan: str, tmp_path: Path) -> None:
    payload = {"model_type": "qwen3_moe", "ep_size": ep_size, "plan": plan, "out_dir": str(tmp_path)}
    for rank, r in enumerate(run_world(world, "tests.training_cases:interleaved_step", payload)):
        assert r["tags"] == [0, 1]
        assert r["grad_worst"] <= TOL, (rank, r["grad_worst_name"], r["grad_worst"])
        assert r["vs_sequential"] <= 1e-6, (rank, r["vs_sequential"])
        # the micro-batches take turns at every exchange instead of running one pass after another: the
        # experts of consecutive calls (one per layer and chunk) belong to alternating micro-batches
        order = [tuple(c) for c in r["order"]]
        threads = [t for t, _ in order]
        assert r["blocks"] >= 2 and all(a != b for a, b in zip(threads, threads[1:], strict=False)), order
        layers = {t: sorted(layer for u, layer in order if u == t) for t in set(threads)}
        assert len(layers) == 2 and layers[threads[0]] == layers[threads[1]], order
