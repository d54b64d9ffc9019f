"""Before/after tests of the code generation (libcst ``CodemodTest`` style): for one family per
archetype, the forwards generated from the templates must equal the reviewed golden files in
tests/golden/ line for line. A deliberate change regenerates them (``tools/update_golden.py``) and
shows up as a diff in review."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from hp_rewrite.rewrite import analyze, generated_functions
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests.rewrite_cases import plan_for

GOLDEN = Path(__file__).resolve().parent / "golden"

CASES = {  # golden file: (model type, forced archetype fields)
    "qwen3_moe-router_module-none": ("qwen3_moe", None),
    "qwen2_moe-router_module-gated": ("qwen2_moe", None),
    "deepseek_v3-sigmoid_group-additive": ("deepseek_v3", {"router": "sigmoid_group"}),
    "mixtral-softmax_topk-none": ("mixtral", {"router": "softmax_topk"}),
    "minimax_m3_vl_text-router_module-scaled": ("minimax_m3_vl_text", None),
    "cohere2_moe-experts_level": ("cohere2_moe", None),
}


def generated(model_type: str, archetype: dict | None) -> str:
    """Every forward generated for the model (the artifact's body, without its versioned header)."""
    model = build_tiny_model(tiny_config(model_type), seed=0)
    functions = generated_functions(analyze(model, plan_for(2, archetype)))
    return "\n\n".join(f"# {f.cls.__qualname__}: {f.archetype}\n{f.source.strip()}\n" for f in functions)


@pytest.mark.parametrize("name", list(CASES))
def test_generated_forward_equals_golden(name: str) -> None:
    model_type, archetype = CASES[name]
    want = (GOLDEN / f"{name}.py.golden").read_text()
    got = generated(model_type, archetype)
    diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), f"golden/{name}.py.golden", "generated"))
    assert got == want, f"generated code changed (tools/update_golden.py after a deliberate change):\n{diff}"
