"""transformers' ``experts_implementation`` on a rewritten model (#25 item 5): each value selects the
matching local-experts backend (``eager`` the per-expert loop, ``grouped_mm`` the plan's choice,
``batched_mm`` a batched matmul over per-row weights) or is refused with the reason, from
``from_pretrained(experts_implementation=...)`` and from ``set_experts_implementation``; what runs is
checked by recording the backend each projection used, and the numbers against plain transformers
loaded with the same value (fp32, forward and every gradient)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import hp_rewrite
from hp_rewrite.hf import quiet_transformers
from hp_rewrite.hf.shrink import tiny_config
from hp_rewrite.plan import Plan
from hp_rewrite.runtime.compute import experts
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.tiny import build_tiny_model

TOL = 1e-5
EP1 = Plan.model_validate({"version": 1, "ep_size": 1})
CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}  # fused; biased + clamped gate
BACKEND = {"eager": "eager", "grouped_mm": "grouped", "batched_mm": "batched"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("impl")
    for family in CLASSES:
        with quiet_transformers():
            build_tiny_model(tiny_config(family), seed=0).save_pretrained(root / family)
    return {family: root / family for family in CLASSES}


@pytest.fixture
def backends_run(monkeypatch) -> list[str]:
    """The backend of every expert projection the rewritten model runs (``experts._project``'s kind)."""
    seen: list[str] = []
    project = experts._project

    def recording(batch, x, weight, bias, transposed, kind, *args):
        seen.append(kind)
        return project(batch, x, weight, bias, transposed, kind, *args)

    monkeypatch.setattr(experts, "_project", recording)
    return seen


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()


def _assert_same_step(plain, ours) -> None:
    ids = torch.randint(0, plain.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    a, b = plain(input_ids=ids).logits, ours(input_ids=ids).logits
    assert _rel(a, b) <= TOL
    a.square().mean().backward()
    b.square().mean().backward()
    mine = dict(ours.named_parameters())
    for name, p in plain.named_parameters():
        assert _rel(p.grad, mine[name].grad) <= TOL, name
    plain.zero_grad()
    ours.zero_grad()


@pytest.mark.parametrize("family", list(CLASSES))
@pytest.mark.parametrize("implementation", list(BACKEND))
def test_from_pretrained_experts_implementation_selects_the_backend(
    family, implementation, checkpoints, backends_run, tmp_path
) -> None:
    cls = getattr(transformers, CLASSES[family])
    kwargs = {"experts_implementation": implementation, "dtype": torch.float32, "attn_implementation": "eager"}
    with quiet_transformers():
        plain = cls.from_pretrained(checkpoints[family], **kwargs).train()
        with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path):
            ours = cls.from_pretrained(checkpoints[family], **kwargs).train()
    assert ours.config._experts_implementation == plain.config._experts_implementation == implementation
    backends_run.clear()  # the archetype probe's run (its own copy runs eager)
    _assert_same_step(plain, ours)
    assert backends_run and set(backends_run) == {BACKEND[implementation]}, backends_run


def test_set_experts_implementation_reselects_or_refuses(checkpoints, backends_run, tmp_path) -> None:
    cls = transformers.Qwen3MoeForCausalLM
    with quiet_transformers():
        plain = cls.from_pretrained(checkpoints["qwen3_moe"], dtype=torch.float32, attn_implementation="eager")
        with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path):
            ours = cls.from_pretrained(checkpoints["qwen3_moe"], dtype=torch.float32, attn_implementation="eager")
    for implementation in ("eager", "batched_mm", "grouped_mm"):
        plain.set_experts_implementation(implementation)
        ours.set_experts_implementation(implementation)
        backends_run.clear()
        _assert_same_step(plain, ours)
        assert set(backends_run) == {BACKEND[implementation]}, (implementation, backends_run)
    # a transformers kernel over the whole unmodified experts module: refused at the next forward, by name
    ours.set_experts_implementation("sonicmoe")
    with pytest.raises(ExpertParallelError, match=r"Qwen3MoeExperts: experts_implementation='sonicmoe'.*'eager'"):
        ours(input_ids=torch.tensor([[1, 2, 3]]))
    ours.set_experts_implementation("grouped_mm")  # and back: runs again
    ours(input_ids=torch.tensor([[1, 2, 3]]))


def test_refused_at_load_and_conflicts_with_the_plan_named(checkpoints, tmp_path) -> None:
    cls = transformers.Qwen3MoeForCausalLM
    with quiet_transformers(), hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path):
        with pytest.raises(ExpertParallelError, match=r"experts_implementation='deepgemm' is a transformers kernel"):
            cls.from_pretrained(checkpoints["qwen3_moe"], experts_implementation="deepgemm")
    grouped = Plan.model_validate({"version": 1, "ep_size": 1, "runtime": {"compute": "grouped"}})
    with quiet_transformers(), hp_rewrite.auto_patch(grouped, artifact_dir=tmp_path):
        with pytest.raises(ExpertParallelError, match=r"asks for the eager backend, the plan's runtime.compute for "
                                                      r"'grouped'"):
            cls.from_pretrained(checkpoints["qwen3_moe"], experts_implementation="eager")
        # transformers' default (grouped_mm) leaves the plan's choice
        model = cls.from_pretrained(checkpoints["qwen3_moe"])
    assert model.config._experts_implementation == "grouped_mm"


def test_plan_compute_batched_runs_batched(checkpoints, backends_run, tmp_path) -> None:
    plan = Plan.model_validate({"version": 1, "ep_size": 1, "runtime": {"compute": "batched"}})
    cls = transformers.GptOssForCausalLM
    with quiet_transformers():
        plain = cls.from_pretrained(checkpoints["gpt_oss"], dtype=torch.float32).train()
        with hp_rewrite.auto_patch(plan, artifact_dir=tmp_path):
            ours = cls.from_pretrained(checkpoints["gpt_oss"], dtype=torch.float32).train()
    backends_run.clear()
    _assert_same_step(plain, ours)
    assert set(backends_run) == {"batched"}, backends_run
