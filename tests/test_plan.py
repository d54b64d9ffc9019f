"""The plan layer: example plans load, defaults, a stable hash, matching, and errors that point at a line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hp_rewrite.plan import DEFAULT_PLAN, Plan, PlanError, load_plan, parse_plan

PLANS = sorted((Path(__file__).resolve().parent.parent / "plans").glob("*.yaml"))
HEAD = "version: 1\nep_size: 2\n"


def error_of(text: str, source: str = "bad.yaml") -> str:
    with pytest.raises(PlanError) as info:
        parse_plan(text, source=source)
    return str(info.value)


# --- example plans ------------------------------------------------------------------------


def test_example_plans_exist() -> None:
    names = {p.name for p in PLANS}
    assert {"auto-ep2.yaml", "auto-ep4.yaml", "deepseek-capacity.yaml", "experts-level-ep2.yaml"} <= names


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
def test_every_example_plan_loads(path: Path) -> None:
    plan = load_plan(path)
    assert plan.version == 1
    assert plan.ep_size >= 1
    plan.runtime.to_options()
    assert load_plan(str(path)) == plan


def test_example_plan_contents() -> None:
    by_name = {p.name: load_plan(p) for p in PLANS}
    assert by_name["auto-ep2.yaml"].ep_size == 2
    assert by_name["auto-ep4.yaml"].ep_size == 4
    assert by_name["auto-ep2.yaml"].modules.include == ["*"]
    ds = by_name["deepseek-capacity.yaml"]
    assert (ds.ep_size, ds.runtime.chunks, ds.runtime.capacity_factor) == (4, 2, 1.25)
    assert (ds.runtime.drop_policy, ds.runtime.renormalize_kept) == ("probs", True)
    assert ds.modules.include == ["model.layers.*.mlp"]
    assert by_name["experts-level-ep2.yaml"].archetype.level == "experts"


# --- defaults, canonical form, hash --------------------------------------------------------


def test_defaults() -> None:
    plan = parse_plan(HEAD)
    assert (plan.version, plan.ep_size) == (1, 2)
    assert plan.modules.include == ["*"] and plan.modules.exclude == []
    assert (plan.archetype.router, plan.archetype.shared, plan.archetype.level) == ("auto", "auto", "auto")
    rt = plan.runtime
    assert (rt.compute, rt.chunks, rt.overlap, rt.capacity_factor) == ("auto", 1, True, None)
    assert (rt.drop_policy, rt.renormalize_kept, rt.router_dtype, rt.timeout_s) == (
        "probs",
        False,
        "auto",
        None,  # the world's own timeout (NCCL: 10 min), never a shorter one unless the plan says so
    )
    assert plan.output.dir is None and plan.extensions == []
    assert DEFAULT_PLAN == parse_plan("version: 1\nep_size: 1\n")
    assert parse_plan(HEAD + "archetype: auto\n") == plan
    # A section with every knob commented out is YAML null: all defaults.
    assert parse_plan(HEAD + "runtime:\n  # chunks: 2\nextensions:\n") == plan


def test_plan_is_frozen() -> None:
    with pytest.raises(ValueError):
        DEFAULT_PLAN.ep_size = 2  # type: ignore[misc]
    with pytest.raises(ValueError):
        DEFAULT_PLAN.runtime.chunks = 2  # type: ignore[misc]


def test_canonical_is_complete_sorted_and_plain() -> None:
    canon = DEFAULT_PLAN.canonical()
    assert list(canon) == sorted(canon)
    assert set(canon) == {"version", "ep_size", "tp_size", "sequence_parallel", "modules", "archetype", "runtime", "routing",
                          "placement", "output", "extensions", "cp_size", "context"}
    assert list(canon["runtime"]) == sorted(canon["runtime"])
    assert canon["runtime"]["timeout_s"] is None and canon["runtime"]["capacity_factor"] is None
    assert json.loads(json.dumps(canon)) == canon
    assert Plan.model_validate(canon) == DEFAULT_PLAN


def test_hash_ignores_key_order_formatting_and_explicit_defaults() -> None:
    a = parse_plan("version: 1\nep_size: 4\nruntime:\n  chunks: 2\n  capacity_factor: 1.25\n")
    b = parse_plan(
        "# same plan\nruntime: {capacity_factor: 1.250, chunks: 2, timeout_s: null}\n\nep_size:   4\nversion: 1\n"
    )
    c = parse_plan(
        "version: 1\nep_size: 4\narchetype: auto\nmodules: {include: ['*']}\nruntime: {chunks: 2, capacity_factor: 1.25}\n"
    )
    assert a.hash() == b.hash() == c.hash()
    assert len(a.hash()) == 64 and int(a.hash(), 16) >= 0
    assert DEFAULT_PLAN.hash() == parse_plan("version: 1\nep_size: 1").hash()


CHANGES = [
    "modules: {include: ['model.layers.*.mlp']}",
    "modules: {exclude: ['model.layers.0.mlp']}",
    "archetype: {router: softmax_topk}",
    "archetype: {shared: gated}",
    "archetype: {level: experts}",
    "runtime: {compute: eager}",
    "runtime: {chunks: 2}",
    "runtime: {overlap: false}",
    "runtime: {capacity_factor: 1.5}",
    "runtime: {drop_policy: position}",
    "runtime: {renormalize_kept: true}",
    "runtime: {dedup: false}",
    "runtime: {defer_expert_grads: true}",
    "runtime: {router_dtype: fp32}",
    "runtime: {timeout_s: 120}",
    "runtime: {grad_bucket_mb: 100}",
    "runtime: {dequant_chunk_mb: 8}",
    "runtime: {fp8_gemm: true}",
    "runtime: {weight_sync_bucket_mb: 64}",
    "runtime: {balance: auto}",
    "runtime: {balance_threshold: 1.5}",
    "runtime: {balance_min_rows: 64}",
    "runtime: {balance_replicas: 4}",
    "routing: {stats: false}",
    "routing: {bias_update_rate: 0.001}",
    "routing: {freeze_router: true}",
    "routing: {replay_in_recompute: false}",
    "routing: {aux_loss: global}",
    "routing: {z_loss_coef: 0.001}",
    "routing: {replay_rollout: true}",
    "output: {dir: generated}",
    "extensions: [my_pkg.archetypes]",
    "cp_size: 2",
]


def test_hash_changes_with_every_knob() -> None:
    texts = [HEAD, "version: 1\nep_size: 4\n"] + [HEAD + change + "\n" for change in CHANGES]
    hashes = {parse_plan(text).hash() for text in texts}
    assert len(hashes) == len(texts)


def test_every_runtime_knob_is_covered_by_the_hash_test() -> None:
    knobs = {c.split("{")[1].split(":")[0] for c in CHANGES if "{" in c}
    fields = set(Plan.model_fields["runtime"].annotation.model_fields)
    fields |= set(Plan.model_fields["archetype"].annotation.model_fields)
    fields |= set(Plan.model_fields["modules"].annotation.model_fields)
    fields |= set(Plan.model_fields["routing"].annotation.model_fields)
    assert fields <= knobs


# --- matching ------------------------------------------------------------------------------


def test_matches_everything_by_default() -> None:
    assert DEFAULT_PLAN.matches("model.layers.3.mlp", "Qwen3MoeSparseMoeBlock")


def test_matches_path_and_class_globs_with_exclude() -> None:
    plan = parse_plan(
        HEAD
        + "modules:\n  include: ['model.layers.*.mlp', '*SparseMoeBlock']\n  exclude: ['model.layers.0.*', 'Mixtral*']\n"
    )
    assert plan.matches("model.layers.5.mlp", "DeepseekV3MoE")  # path glob
    assert plan.matches("model.decoder.7.moe", "Qwen3MoeSparseMoeBlock")  # class-name glob
    assert not plan.matches("model.decoder.7.moe", "DeepseekV3MoE")  # neither
    assert not plan.matches("model.layers.0.mlp", "Qwen3MoeSparseMoeBlock")  # excluded by path
    assert not plan.matches("model.layers.4.mlp", "MixtralSparseMoeBlock")  # excluded by class
    assert not plan.matches("model.layers.4.MLP", "DeepseekV3MoE")  # case-sensitive


def test_matches_exact_class_name() -> None:
    plan = parse_plan(HEAD + "modules: {include: [Qwen3MoeSparseMoeBlock]}\n")
    assert plan.matches("anything", "Qwen3MoeSparseMoeBlock")
    assert not plan.matches("anything", "Qwen2MoeSparseMoeBlock")


# --- runtime options -----------------------------------------------------------------------


def test_to_options_round_trip() -> None:
    from hp_rewrite.runtime.options import RuntimeOptions

    plan = parse_plan(
        HEAD
        + "runtime:\n  compute: eager\n  chunks: 4\n  overlap: false\n  capacity_factor: 2\n"
        + "  drop_policy: position\n  renormalize_kept: true\n  dedup: false\n  defer_expert_grads: true\n"
    )
    opts = plan.runtime.to_options()
    assert opts == RuntimeOptions(
        compute="eager",
        chunks=4,
        overlap=False,
        capacity_factor=2.0,
        drop_policy="position",
        renormalize_kept=True,
        dedup=False,
        defer_expert_grads=True,
    )
    for key, value in opts.as_dict().items():
        assert getattr(plan.runtime, key) == value
    assert DEFAULT_PLAN.runtime.to_options() == RuntimeOptions()


def test_reading_a_plan_imports_neither_torch_nor_extensions() -> None:
    code = (
        "import sys; from hp_rewrite.plan import parse_plan\n"
        "p = parse_plan('version: 1\\nep_size: 2\\nextensions: [not_installed_pkg.archetypes]\\n')\n"
        "assert p.extensions == ['not_installed_pkg.archetypes']\n"
        "assert 'torch' not in sys.modules and 'not_installed_pkg' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


# --- errors --------------------------------------------------------------------------------

ERRORS = [
    # (yaml text, line, dotted path, fragments of the message)
    (
        HEAD + "runtime:\n  chunkz: 2\n",
        4,
        "runtime.chunkz",
        ["unknown key", "chunks, compute", "did you mean 'chunks'"],
    ),
    (
        "version: 1\nep_sise: 2\n",
        2,
        "ep_sise",
        ["unknown key", "archetype, context, cp_size, ep_size, extensions", "did you mean 'ep_size'"],
    ),
    (
        HEAD + "archetype:\n  levle: block\n",
        4,
        "archetype.levle",
        ["allowed keys here: level, router, shared"],
    ),
    (HEAD + "frobnicate: 1\n", 3, "frobnicate", ["unknown key", "allowed keys here:"]),
    (HEAD + "runtime:\n  chunks: 0\n", 4, "runtime.chunks", [">= 1", "got 0"]),
    (HEAD + "runtime:\n  chunks: '2'\n", 4, "runtime.chunks", ["must be an integer", "got '2'"]),
    (HEAD + "runtime:\n  chunks: 2.5\n", 4, "runtime.chunks", ["must be an integer"]),
    (HEAD + "runtime:\n  overlap: 1\n", 4, "runtime.overlap", ["true or false"]),
    (HEAD + "runtime:\n  capacity_factor: 0\n", 4, "runtime.capacity_factor", ["> 0", "got 0"]),
    (HEAD + "runtime:\n  capacity_factor: -1.5\n", 4, "runtime.capacity_factor", ["> 0"]),
    (HEAD + "runtime:\n  capacity_factor: .nan\n", 4, "runtime.capacity_factor", ["finite"]),
    (HEAD + "runtime:\n  timeout_s: 0\n", 4, "runtime.timeout_s", ["> 0"]),
    (
        HEAD + "runtime:\n  compute: fast\n",
        4,
        "runtime.compute",
        ["'fast'", "choose one of: auto, grouped, eager"],
    ),
    (
        HEAD + "runtime:\n  drop_policy: random\n",
        4,
        "runtime.drop_policy",
        ["choose one of: probs, position"],
    ),
    (
        HEAD + "runtime:\n  router_dtype: bf16\n",
        4,
        "runtime.router_dtype",
        ["choose one of: auto, fp32, logits"],
    ),
    (
        HEAD + "archetype:\n  router: top2\n",
        4,
        "archetype.router",
        ["choose one of: auto, softmax_topk, sigmoid_group, topk_router_module"],
    ),
    (
        HEAD + "archetype:\n  shared: maybe\n",
        4,
        "archetype.shared",
        ["choose one of: auto, none, additive, gated, scaled"],
    ),
    (HEAD + "archetype:\n  level: layer\n", 4, "archetype.level", ["choose one of: auto, block, experts"]),
    (HEAD + "archetype: block\n", 3, "archetype", ["only 'auto'"]),
    (HEAD + "archetype: [auto]\n", 3, "archetype", ["must be a mapping"]),
    ("version: 1\nep_size: 0\n", 2, "ep_size", [">= 1"]),
    ("version: 1\nep_size: true\n", 2, "ep_size", ["must be an integer", "got true"]),
    ("version: 2\nep_size: 1\n", 1, "version", ["unsupported plan version 2", "version 1"]),
    ("# my plan\nversion: 1\n", 2, "ep_size", ["required"]),
    (
        HEAD + "modules:\n  include:\n    - model.*\n    - ''\n",
        6,
        "modules.include[1]",
        ["must not be empty"],
    ),
    (HEAD + "modules:\n  exclude: [' x']\n", 4, "modules.exclude[0]", ["whitespace"]),
    (HEAD + "modules:\n  include: []\n", 4, "modules.include", ["must not be empty"]),
    (HEAD + "modules:\n  include: model.layers.*.mlp\n", 4, "modules.include", ["must be a list"]),
    (HEAD + "modules:\n  include: [3]\n", 4, "modules.include[0]", ["must be a string", "got 3"]),
    (HEAD + "runtime: 4\n", 3, "runtime", ["must be a mapping", "got 4"]),
    (HEAD + "routing:\n  bias_update_rate: -0.001\n", 4, "routing.bias_update_rate", [">= 0"]),
    (HEAD + "routing:\n  freeze_router: 1\n", 4, "routing.freeze_router", ["got 1"]),
    (HEAD + "output:\n  dir: ''\n", 4, "output.dir", ["must not be empty"]),
    (
        HEAD + "extensions:\n  - ok.module\n  - not-a-module\n",
        5,
        "extensions[1]",
        ["dotted Python module name"],
    ),
    (HEAD + "extensions: [import.x]\n", 3, "extensions[0]", ["dotted Python module name"]),
    (HEAD + "runtime:\n  chunks: 1\n  chunks: 2\n", 5, "runtime.chunks", ["duplicate key", "line 4"]),
    (HEAD + "runtime: {1: 2}\n", 3, "runtime", ["plain strings"]),
    (
        "version: 1\nep_size: !!python/object/apply:os.system ['true']\n",
        2,
        "ep_size",
        ["!!python/object", "safe YAML"],
    ),
]


@pytest.mark.parametrize(
    ("text", "line", "path", "fragments"), ERRORS, ids=[e[2] + f"-{i}" for i, e in enumerate(ERRORS)]
)
def test_error_names_file_line_path_and_fix(text: str, line: int, path: str, fragments: list[str]) -> None:
    message = error_of(text)
    assert f"bad.yaml:{line}: {path}: " in message
    for fragment in fragments:
        assert fragment in message
    assert "pydantic" not in message and "errors.pydantic.dev" not in message and "Traceback" not in message


def test_plan_error_is_a_value_error_with_problems() -> None:
    with pytest.raises(ValueError) as info:
        parse_plan("version: 1\nep_size: 0\nruntime: {chunks: 0, compute: fast}\n", source="p.yaml")
    err = info.value
    assert isinstance(err, PlanError)
    assert [(p.line, p.path) for p in err.problems] == [
        (2, "ep_size"),
        (3, "runtime.chunks"),
        (3, "runtime.compute"),
    ]
    assert str(err).count("\n") == 2


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("version: 1\nep_size: [2\n", 3, "invalid YAML"),
        ("version: 1\n ep_size: 2\n", 2, "invalid YAML"),
        ("version: 1\n---\nversion: 1\n", 2, "single document"),
        ("- version: 1\n", 1, "the plan is a list"),
        ("just text\n", 1, "the plan is a string"),
        ("", 1, "the plan is empty"),
        ("!!python/object/apply:os.system ['true']\n", 1, "!!python/object/apply:os.system"),
    ],
)
def test_document_level_errors(text: str, line: int, fragment: str) -> None:
    message = error_of(text)
    assert message.startswith(f"bad.yaml:{line}: ")
    assert fragment in message


@pytest.mark.parametrize(("extra", "fix"), [
    ("tp_size: 2\nsequence_parallel: true", "sequence_parallel: false"),
    ("runtime: {capacity_factor: 1.25}", "capacity_factor: null"),
    ("routing: {aux_loss: global}", "aux_loss: micro_batch"),
    ("routing: {z_loss_coef: 0.001}", "z_loss_coef: 0"),
    ("routing: {replay_rollout: true}", "replay_rollout: false"),
])
def test_context_parallelism_refuses_what_it_does_not_compose_with(extra: str, fix: str) -> None:
    message = error_of(f"version: 1\nep_size: 2\ncp_size: 2\n{extra}\n")
    assert "cp_size 2 with" in message and f"set {fix}" in message and "or cp_size: 1" in message


def test_context_section() -> None:
    plan = parse_plan("version: 1\nep_size: 2\ncp_size: 2\ncontext: {scheme: ulysses}\n")
    assert (plan.cp_size, plan.context.scheme) == (2, "ulysses")
    assert parse_plan("version: 1\nep_size: 2\ntp_size: 2\ncp_size: 2\n").tp_size == 2  # tp x cp composes
    local = parse_plan("version: 1\nep_size: 2\ncp_size: 2\ncontext: {logits: local}\n")
    assert local.context.logits == "local" and local.hash() != plan.hash()
    assert "context.logits: local needs cp_size > 1" in error_of("version: 1\nep_size: 2\ncontext: {logits: local}\n")
    assert "whole, local" in error_of("version: 1\nep_size: 2\ncp_size: 2\ncontext: {logits: some}\n")
    assert plan.hash() == parse_plan("version: 1\nep_size: 2\ncp_size: 2\n").hash()
    assert "choose one of: ulysses" in error_of("version: 1\nep_size: 2\ncp_size: 2\ncontext: {scheme: ring}\n")
    assert ">= 1" in error_of("version: 1\nep_size: 2\ncp_size: 0\n")


def test_python_tags_never_construct(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f"version: 1\nep_size: 1\noutput:\n  dir: !!python/object/apply:os.system ['touch {marker}']\n"
    assert "bad.yaml:4: output.dir: " in error_of(text)
    assert not marker.exists()


def test_load_plan_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(PlanError, match="nope.yaml: no such plan file"):
        load_plan(missing)
    bad = tmp_path / "bad-plan.yaml"
    bad.write_text("version: 1\nep_size: 2\nruntime:\n  compute: fast\n")
    with pytest.raises(
        PlanError, match=r"bad-plan\.yaml:4: runtime\.compute: .*choose one of: auto, grouped, eager"
    ):
        load_plan(bad)
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path)


def test_parse_plan_default_source() -> None:
    with pytest.raises(PlanError, match=r"^<string>:1: version: "):
        parse_plan("version: 3\nep_size: 1\n")


def _profile(path, counts: list[int]) -> None:
    layers = [{"path": "model.layers.0.mlp", "layer": 0, "tokens_per_expert": counts}]
    path.write_text(json.dumps({"model_type": "qwen3_moe", "layers": layers}))


def test_placement_profile_is_read_relative_to_the_plan_and_hashed(tmp_path) -> None:
    _profile(tmp_path / "profile.json", [9, 1, 1, 1])
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(HEAD + "placement:\n  strategy: balanced\n  profile: profile.json\n")
    plan = load_plan(plan_file)
    assert plan.placement.loads_for("model.layers.0.mlp") == [9, 1, 1, 1]
    assert plan.placement.loads_for("model.layers.1.mlp") is None
    inline = parse_plan(HEAD + "placement:\n  strategy: balanced\n  loads: {model.layers.0.mlp: [9, 1, 1, 1]}\n")
    assert inline.placement.loads == plan.placement.loads
    before = plan.hash()
    _profile(tmp_path / "profile.json", [1, 9, 1, 1])  # same path, new loads: a different plan
    assert load_plan(plan_file).hash() != before
    assert DEFAULT_PLAN.placement.strategy == "contiguous" and DEFAULT_PLAN.placement.loads_for("x") is None


@pytest.mark.parametrize(
    ("placement", "where", "what"),
    [
        ("  strategy: balanced\n", "placement", "needs the routing loads"),
        ("  strategy: balanced\n  profile: missing.json\n", "placement.profile", "no such file"),
        ("  strategy: balanced\n  profile: bad.json\n", "placement.profile", "cannot read it as JSON"),
        ("  strategy: balanced\n  profile: plan.yaml\n", "placement.profile", "cannot read it as JSON"),
        ("  strategy: balanced\n  profile: other.json\n", "placement.profile", "not a routing profile"),
        ("  profile: good.json\n", "placement", "only used with strategy: balanced"),
        ("  strategy: balanced\n  profile: good.json\n  loads: {a: [1]}\n", "placement.profile", "not both"),
        ("  strategy: balanced\n  loads: {a: [1, -2]}\n", "placement.loads.a[1]", ">= 0"),
        ("  strategy: balanced\n  loads: {a: []}\n", "placement", "is empty"),
        ("  strategy: spread\n", "placement.strategy", "contiguous, balanced"),
    ],
)
def test_placement_errors_name_the_field(tmp_path, placement: str, where: str, what: str) -> None:
    _profile(tmp_path / "good.json", [1, 2])
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"layers": [{"path": 3}]}))
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(HEAD + "placement:\n" + placement)
    with pytest.raises(PlanError) as info:
        load_plan(plan_file)
    problem = info.value.problems[0]
    assert problem.path == where and what in problem.message, str(info.value)
    assert problem.line is not None and problem.line >= 3
