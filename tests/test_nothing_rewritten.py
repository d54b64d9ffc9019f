"""A plan that rewrites no block of a model is refused, never a model marked expert-parallel with every
expert still on every rank (#23 item 1): through auto_patch + from_pretrained (a remote-code model, a
transformers model whose experts are not routed per token, a dense model), hp_rewrite.from_pretrained, rewrite_model,
install of an artifact written for another model, and apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

import hp_rewrite
from hp_rewrite.cli import main
from hp_rewrite.errors import SelectionError
from hp_rewrite.hf import pretrained_model_class
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import Plan
from hp_rewrite.tiny import make_tiny

from .remote_code import write_checkpoint

EP1 = Plan.model_validate({"version": 1, "ep_size": 1})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nothing")
    return {"remote": write_checkpoint(root / "remote", router="softmax_temperature"), "dense": make_tiny("qwen3", root / "dense"),
            "vitpose": make_tiny("vitpose_backbone", root / "vitpose"),
            "qwen3_moe": make_tiny("qwen3_moe", root / "qwen3_moe")}


def test_remote_code_model_whose_router_fits_no_archetype_is_refused(dirs, tmp_path) -> None:
    """Module-list experts are matched (tests/test_remote_code.py); a router no archetype reproduces
    (softmax of logits / 0.7) leaves the block unmatched, and that is an error naming why."""
    original = pretrained_model_class().__dict__["from_pretrained"]
    with pytest.raises(SelectionError) as e, hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        transformers.AutoModelForCausalLM.from_pretrained(dirs["remote"], trust_remote_code=True)
    msg = str(e.value)
    assert "rewrites no MoE block of TinyMoeForCausalLM" in msg and "every rank would hold every expert" in msg
    assert "model.layers.{0-1}.mlp (TinyMoeSparseBlock): unmatched: block softmax_topk+none: output differs" in msg
    assert f"describe-moe {dirs['remote']} --trust-remote-code" in msg
    assert pretrained_model_class().__dict__["from_pretrained"] is original  # the patch is gone
    assert not (tmp_path / "art").exists()  # no artifact written


def test_transformers_model_whose_experts_are_not_routed_is_refused(dirs, tmp_path) -> None:
    """ViTPose's "experts" are picked by a dataset index, not per token: nothing to dispatch."""
    with pytest.raises(SelectionError, match=r"\(VitPoseNaiveMoe\): its 8 experts are separate modules .* not chosen "
                                             r"per token by a router"), \
            hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        transformers.VitPoseBackbone.from_pretrained(dirs["vitpose"])


def test_dense_model_through_from_pretrained_is_refused(dirs, tmp_path) -> None:
    with pytest.raises(SelectionError, match="no MoE block in this qwen3 model"):
        hp_rewrite.from_pretrained(dirs["dense"], plan=EP1, artifact_dir=tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_rewrite_model_with_globs_selecting_no_block_is_refused(dirs, tmp_path) -> None:
    plan = Plan.model_validate({"version": 1, "ep_size": 1, "modules": {"include": ["model.layers.99.*"]}})
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["qwen3_moe"])
    with pytest.raises(SelectionError, match=r"select none of the \d+ MoE blocks \(model\.layers\.0\.mlp"):
        rewrite_model(model, plan, artifact_dir=tmp_path / "art")
    assert getattr(model, "hp_rewrite", None) is None


def test_an_artifact_of_another_model_installs_nothing_and_is_refused(dirs, tmp_path) -> None:
    """The cached path: an artifact whose classes the model does not have patches nothing, so it raises."""
    from hp_rewrite.loading.install import install
    from hp_rewrite.match.generate import ensure_artifact
    from hp_rewrite.runtime.group.groups import ExpertParallelGroup

    moe = transformers.AutoModelForCausalLM.from_pretrained(dirs["qwen3_moe"])
    artifact = ensure_artifact(moe, EP1, moe.config, tmp_path / "art")
    remote = transformers.AutoModelForCausalLM.from_pretrained(dirs["remote"], trust_remote_code=True)
    with pytest.raises(SelectionError, match="rewrites no MoE block of TinyMoeForCausalLM"):
        install(remote, artifact, EP1, ExpertParallelGroup.single())


def test_apply_on_unrouted_experts_exits_2(dirs, tmp_path, capsys) -> None:
    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nep_size: 1\n")
    assert main(["apply", str(plan), str(dirs["vitpose"]), "--out", str(tmp_path / "gen")]) == 2
    msg = capsys.readouterr().out
    assert "rewrites no MoE block" in msg and "not chosen per token" in msg and "Traceback" not in msg
    assert not (tmp_path / "gen").exists()
