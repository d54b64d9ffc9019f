"""User archetypes (a plan's ``extensions:``): a custom MoE block that no built-in archetype fits is
rewritten through ``tests/ext_temperature.py`` with parity against the unmodified model at EP=1 and
EP=2 (real gloo ranks); plus the errors, the artifact key and the structural predicate."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest

from hp_rewrite.codegen.artifacts import find_current
from hp_rewrite.codegen.specialize import TemplateError, attribute
from hp_rewrite.launch import run_world
from hp_rewrite.match import register_archetype
from hp_rewrite.plan import PlanError
from hp_rewrite.rewrite import analyze, generate, generated_functions
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests import ext_temperature
from tests.ext_support import build_model, compare, plan_for

TOL = 1e-5
EXTENSION = "tests.ext_temperature:temperature_topk"


def _check(result: dict) -> None:
    assert result["unmatched"] == []
    assert result["patched"] == ["layers.0", "layers.1"]
    assert {a.get("extension") for a in result["archetypes"]} == {EXTENSION}
    worst = max(result["errors"], key=result["errors"].get)
    assert result["errors"][worst] <= TOL, (worst, result["errors"][worst])
    assert any(k.startswith("grad/layers.0.experts.") for k in result["errors"])


def test_no_builtin_archetype_fits_the_custom_block() -> None:
    analysis = analyze(build_model(), plan_for(1))
    assert analysis.matched == [] and len(analysis.unmatched) == 2
    reason = analysis.unmatched[0].reason
    assert "block softmax_topk+none: output differs" in reason and "experts level: raised" in reason


def test_extension_rewrites_the_block_ep1(tmp_path: Path) -> None:
    result = compare(str(tmp_path))
    _check(result)
    text = (Path(result["artifact"]) / "modeling_ep.py").read_text()
    assert "def TemperatureMoeBlock_forward(self, hidden_states):" in text and "top / 0.7" in text


def test_extension_rewrites_the_block_ep2(tmp_path: Path) -> None:
    results = run_world(2, "tests.ext_support:run_world_case", {"out_dir": str(tmp_path)})
    for result in results:
        _check(result)
        assert result["local_experts"] == [2, 2]  # 4 experts sharded over 2 ranks
    assert results[0]["artifact"] == results[1]["artifact"]


def test_module_registering_nothing_is_a_clear_error() -> None:
    with pytest.raises(PlanError) as err:
        analyze(build_model(), plan_for(1, ["tests.ext_temperature", "tests.ext_empty"]))
    assert "extensions[1]" in str(err.value) and "'tests.ext_empty' registers no archetype" in str(err.value)


def test_module_that_cannot_be_imported_is_a_clear_error() -> None:
    with pytest.raises(PlanError) as err:
        analyze(build_model(), plan_for(1, ["tests.no_such_extension"]))
    assert "extensions[0]" in str(err.value) and "cannot import the extension module 'tests.no_such_extension'" in str(
        err.value
    )


def test_extension_is_not_used_when_its_predicate_is_false() -> None:
    model = build_tiny_model(tiny_config("qwen3_moe"), seed=0)
    with_ext = analyze(model, plan_for(1, ["tests.ext_temperature"]))
    without = analyze(model, plan_for(1))
    assert with_ext.unmatched == [] and with_ext.matched
    assert all("extension" not in r.archetype.as_dict() for r in with_ext.matched)
    assert f"extension {EXTENSION}: predicate false" in with_ext.matched[0].tried
    assert [f.source for f in generated_functions(with_ext)] == [f.source for f in generated_functions(without)]


def test_edited_extension_selects_a_new_artifact(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(Path(ext_temperature.__file__), src / "hp_ext_copy.py")
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.delitem(sys.modules, "hp_ext_copy", raising=False)
    model, plan = build_model(), plan_for(1, ["hp_ext_copy"])
    out = tmp_path / "out"
    _, first = generate(model, plan, model.config, out)
    assert first.manifest["classes"]["tests.ext_support.TemperatureMoeBlock"]["archetype"]["extension"] == (
        "hp_ext_copy:temperature_topk"
    )
    assert find_current(out, plan.hash(), model.config) == first
    with open(src / "hp_ext_copy.py", "a") as f:
        f.write("# edited\n")
    assert find_current(out, plan.hash(), model.config) is None  # the cached artifact is stale
    _, second = generate(model, plan, model.config, out)
    assert second.directory != first.directory
    monkeypatch.delitem(sys.modules, "hp_ext_copy")


def test_template_and_parameters_must_agree() -> None:
    @dataclasses.dataclass(frozen=True)
    class Incomplete:  # no TEMPERATURE
        ROUTER: str = attribute()
        EXPERTS: str = attribute()
        TOP_K: int = 1

    with pytest.raises(TemplateError, match="TEMPERATURE"):
        register_archetype("incomplete", template=ext_temperature, params=Incomplete, predicate=lambda s: True,
                           derive=lambda s, probe: None)

    @dataclasses.dataclass(frozen=True)
    class ConstantRouter:  # ROUTER declared as a constant, not an attribute
        EXPERTS: str = attribute()
        ROUTER: str = "gate"
        TOP_K: int = 1
        TEMPERATURE: float = 1.0

    with pytest.raises(TemplateError, match="ROUTER"):
        register_archetype("wrong_kind", template=ext_temperature, params=ConstantRouter, predicate=lambda s: True,
                           derive=lambda s, probe: None)
