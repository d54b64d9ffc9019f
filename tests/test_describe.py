"""``hp-rewrite describe-moe``: structure, archetype or reason, plan snippet, grouping, unsupported MoE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hp_rewrite.cli import main
from hp_rewrite.match.diagnosis import describe
from hp_rewrite.match.snippets import UNTOUCHED, compact_paths, ep_size_for, path_glob
from hp_rewrite.plan import parse_plan

try:
    from hp_rewrite.hf.shrink import tiny_config
except ImportError:  # the tiny-model helper is optional here: a few explicit configs suffice
    tiny_config = None


def _config(model_type: str, **overrides):
    if tiny_config is not None:
        cfg = tiny_config(model_type)
    else:
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(
            model_type,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            moe_intermediate_size=32,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            vocab_size=128,
        )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    """model type -> a directory holding only its tiny config.json (describe-moe reads nothing else)."""
    root = tmp_path_factory.mktemp("describe")
    cache: dict[str, Path] = {}

    def get(model_type: str, **overrides) -> Path:
        key = model_type + repr(sorted(overrides.items()))
        if key not in cache:
            d = root / f"{model_type}-{len(cache)}"
            _config(model_type, **overrides).save_pretrained(d)
            cache[key] = d
        return cache[key]

    return get


def run_json(capsys, directory: Path) -> dict:
    capsys.readouterr()
    assert main(["describe-moe", str(directory), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def only_group(doc: dict) -> dict:
    assert len(doc["groups"]) == 1, doc["groups"]
    return doc["groups"][0]


def check_snippet(group: dict, ep_size: int, include: list[str]) -> None:
    plan = parse_plan(group["plan_snippet"], source="snippet")
    assert plan.ep_size == ep_size
    assert plan.modules.include == include


# -- experts holders: archetype chosen by execution ------------------------------------------------


def test_qwen3_moe_block_archetype_grouped(capsys, config_dirs) -> None:
    doc = run_json(capsys, config_dirs("qwen3_moe"))
    assert doc["model_type"] == "qwen3_moe" and doc["non_contract"] == []
    g = only_group(doc)
    assert g["paths"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert g["class"] == "Qwen3MoeSparseMoeBlock"
    assert {c["name"] for c in g["children"]} == {"gate", "experts"}
    assert g["params"]["experts.gate_up_proj"] == [8, 64, 64]
    assert g["params"]["experts.down_proj"] == [8, 64, 32]
    st = g["structure"]
    assert (st["router"], st["experts"], st["num_experts"], st["top_k"]) == ("gate", "experts", 8, 2)
    assert st["shared"] is None and st["shared_gate"] is None and st["others"] == []
    assert st["selection_bias"] is None  # routing.bias_update_rate has nothing to move
    assert g["archetype"]["level"] == "block" and g["archetype"]["shared"] == "none"
    assert g["reason"] is None
    check_snippet(g, 8, ["model.layers.*.mlp"])
    assert "archetype: auto" in g["plan_snippet"]


def test_many_layers_print_as_one_group(capsys, config_dirs) -> None:
    doc = run_json(capsys, config_dirs("qwen3_moe", num_hidden_layers=48))
    g = only_group(doc)
    assert len(g["paths"]) == 48
    assert main(["describe-moe", str(config_dirs("qwen3_moe", num_hidden_layers=48))]) == 0
    out = capsys.readouterr().out
    assert "Qwen3MoeSparseMoeBlock x48" in out and "model.layers.{0-47}.mlp" in out
    assert "model.layers.17.mlp" not in out  # compact: no per-layer listing


def test_qwen2_moe_gated_shared(capsys, config_dirs) -> None:
    g = only_group(run_json(capsys, config_dirs("qwen2_moe")))
    assert g["structure"]["shared"] == "shared_expert"
    assert g["structure"]["shared_gate"] == "shared_expert_gate"
    assert g["archetype"]["level"] == "block" and g["archetype"]["shared"] == "gated"


def test_deepseek_v3_additive_shared_skips_dense_layers(capsys, config_dirs) -> None:
    cfg_dir = config_dirs("deepseek_v3")
    cfg = json.loads((cfg_dir / "config.json").read_text())
    dense = cfg["first_k_dense_replace"]
    assert 1 <= dense < cfg["num_hidden_layers"]
    g = only_group(run_json(capsys, cfg_dir))
    # the first `first_k_dense_replace` layers are dense: no MoE block there
    assert g["paths"] == [f"model.layers.{i}.mlp" for i in range(dense, cfg["num_hidden_layers"])]
    assert g["structure"]["shared"] == "shared_experts"
    assert g["structure"]["selection_bias"] == "gate.e_score_correction_bias"
    assert g["archetype"]["shared"] == "additive"
    assert main(["describe-moe", str(cfg_dir)]) == 0
    assert "selection bias gate.e_score_correction_bias (routing.bias_update_rate" in capsys.readouterr().out
    check_snippet(g, 8, ["model.layers.*.mlp"])
    assert "model.layers.0.mlp" in g["plan_snippet"]  # the glob also matches the dense MLPs: said so


def test_gpt_oss_interleaved_biased_layout(capsys, config_dirs) -> None:
    g = only_group(run_json(capsys, config_dirs("gpt_oss")))
    assert g["structure"]["router"] == "router"
    assert "interleaved" in g["structure"]["layout"] and "bias" in g["structure"]["layout"]
    assert "experts.gate_up_proj_bias" in g["params"]
    assert g["archetype"] is not None and g["archetype"]["shared"] == "none"


def test_console_output(capsys, config_dirs) -> None:
    capsys.readouterr()
    assert main(["describe-moe", str(config_dirs("qwen2_moe"))]) == 0
    out = capsys.readouterr().out
    for text in (
        "Qwen2MoeSparseMoeBlock x2",
        "model.layers.{0-1}.mlp",
        "shared gate: shared_expert_gate",
        "archetype: block-level",
        "ep_size: 8",
        "model.layers.*.mlp",
    ):
        assert text in out, text


# -- MoE that does not follow the experts contract -------------------------------------------------


def test_llama4_input_scaled_experts_get_a_block_level_archetype(capsys, config_dirs) -> None:
    # Llama4TextExperts.forward(hidden) takes no routing: the block scales the experts' input by the router
    # score. The holder is found by structure and only the block-level input_scaled archetype drives it.
    doc = run_json(capsys, config_dirs("llama4"))
    assert doc["non_contract"] == []
    assert len(doc["groups"]) == 1
    g = doc["groups"][0]
    assert g["class"] == "Llama4TextMoe" and g["reason"] is None
    assert g["paths"] and all(p.endswith(".feed_forward") for p in g["paths"])
    assert g["archetype"]["level"] == "block" and g["archetype"]["router"] == "input_scaled"
    assert g["archetype"]["shared"] == "additive" and g["archetype"]["names"]["ROUTER"] == "router"
    assert "model.layers.*.feed_forward" in g["plan_snippet"]


def test_switch_transformers_expert_modules(capsys, config_dirs) -> None:
    """Its experts (a ModuleDict of wi/wo MLPs) are found by structure and driven at the experts level by
    the model's own top-1 capacity router; the report names the router inside its router module and the
    experts' roles."""
    doc = run_json(capsys, config_dirs("switch_transformers"))
    assert doc["non_contract"] == []
    (g,) = doc["groups"]
    assert g["class"] == "SwitchTransformersSparseMLP" and g["archetype"]["level"] == "experts"
    assert "encoder.block.0.layer.1.mlp" in g["paths"] and any(p.startswith("decoder.") for p in g["paths"])
    st = g["structure"]
    assert st["layout"] == "modules-up-only" and st["num_experts"] == 8 and st["router_inside"] == "router.classifier"
    assert st["expert_modules"] == "8 x SwitchTransformersDenseActDense: up wi, down wo, activation act (ReLU)"
    assert main(["describe-moe", str(config_dirs("switch_transformers"))]) == 0
    out = capsys.readouterr().out
    assert "layout modules-up-only, 8 experts" in out and "router: router.classifier (inside a child" in out


def test_dense_model_says_no_moe(capsys, config_dirs) -> None:
    doc = run_json(capsys, config_dirs("llama"))
    assert doc["groups"] == [] and doc["non_contract"] == []
    assert "no MoE" in doc["message"]
    assert main(["describe-moe", str(config_dirs("llama"))]) == 0
    assert "no MoE" in capsys.readouterr().out


def test_missing_config_is_a_user_error(capsys, tmp_path) -> None:
    capsys.readouterr()
    assert main(["describe-moe", str(tmp_path / "nowhere"), "--json"]) == 2
    captured = capsys.readouterr()
    assert "no config.json" in captured.out + captured.err
    assert "Traceback" not in captured.out + captured.err


# -- synthetic modules: each failed check is named ---------------------------------------------------

H, E, I = 16, 4, 8  # noqa: E741 - the usual MoE size names


class _Block(nn.Module):
    def __init__(self, experts: nn.Module | None) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.num_experts = E
        if experts is not None:
            self.experts = experts


class _Model(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.layers = nn.ModuleList([make() for _ in range(3)])


class _OddNames(nn.Module):  # right signature, unknown weight names
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.w_in = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.w_out = nn.Parameter(torch.zeros(E, H, I))

    def forward(self, hidden, top_k_index, top_k_weights):
        return hidden


class _Flat(nn.Module):  # [E*I, H] weights
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.w1 = nn.Parameter(torch.zeros(E * I, H))
        self.v1 = nn.Parameter(torch.zeros(E * I, H))

    def forward(self, x, w1, v1):
        return x


class _FFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(H, I)
        self.wo = nn.Linear(I, H)


def _describe(make) -> dict:
    with torch.device("meta"):
        model = _Model(make)
    return describe(model, None)


@pytest.mark.parametrize(
    ("make", "kind", "needle"),
    [
        (lambda: _Block(_OddNames()), "unknown-weight-names", "w_in, w_out"),
        (lambda: _Block(_Flat()), "flat-2d-experts", f"{E} experts x {I} rows"),
        (lambda: _Block(nn.ModuleList([_FFN() for _ in range(E)])), "expert-modules", "capacity"),
        (lambda: _Block(None), "router-without-experts", f"gives {E} logits"),
    ],
    ids=["unknown-names", "flat-2d", "module-list", "router-only"],
)
def test_non_contract_reasons(make, kind: str, needle: str) -> None:
    doc = _describe(make)
    assert doc["groups"] == []
    assert len(doc["non_contract"]) == 1, doc["non_contract"]
    f = doc["non_contract"][0]
    assert f["kind"] == kind and needle in f["reason"], f["reason"]
    assert len(f["paths"]) == 3 and f["status"] == UNTOUCHED and f["action"]


def test_helpers() -> None:
    assert path_glob("model.layers.12.mlp") == "model.layers.*.mlp"
    assert compact_paths(["a.0.m", "a.1.m", "a.2.m", "a.5.m"]) == "a.{0-2,5}.m"
    assert compact_paths(["x.1", "y.1"]) == "x.1, y.1"
    assert [ep_size_for(n) for n in (64, 12, 6, 7)] == [8, 4, 2, 1]


class _WrongMathExperts(nn.Module):  # the experts contract by structure, but not its computation
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.act_fn = nn.SiLU()

    def forward(self, hidden, top_k_index, top_k_weights):
        return hidden * top_k_weights.sum(-1, keepdim=True)


class _RoutedBlock(_Block):
    def forward(self, x):
        h = x.reshape(-1, H)
        w, idx = torch.softmax(self.gate(h), -1).topk(2, -1)
        return self.experts(h, idx, w).reshape(x.shape)


def test_unmatched_holder_gets_the_reason(capsys) -> None:
    doc = _describe(lambda: _RoutedBlock(_WrongMathExperts()))
    assert doc["non_contract"] == []
    g = only_group(doc)
    assert g["archetype"] is None and "differs" in g["reason"]
    assert len(g["paths"]) == 3 and g["structure"]["router"] == "gate"
    check_snippet(g, 4, ["layers.*"])
    from hp_rewrite.cli.describe import print_report

    print_report(doc)
    out = capsys.readouterr().out
    assert "no archetype fits" in out and UNTOUCHED in out and "differs" in out


def test_large_blocks_are_confirmed_on_a_shrunk_copy(capsys, config_dirs, monkeypatch) -> None:
    import hp_rewrite.match.probe_size as probe_size

    direct = only_group(run_json(capsys, config_dirs("qwen2_moe")))
    monkeypatch.setattr(probe_size, "PROBE_LIMIT_PARAMS", 0)
    doc = run_json(capsys, config_dirs("qwen2_moe"))
    assert "shrunk copy" in doc["note"]
    g = only_group(doc)
    assert g["archetype"] == direct["archetype"] and g["paths"] == direct["paths"]


def test_records_round_trip_the_json_document(capsys, config_dirs) -> None:
    from hp_rewrite.match.diagnosis import Diagnosis

    for model_type in ("qwen2_moe", "llama4", "llama"):
        doc = run_json(capsys, config_dirs(model_type))
        assert json.dumps(Diagnosis.from_json(doc).to_json()) == json.dumps(doc)


def test_analysis_errors_are_collected_for_the_diagnosis(monkeypatch) -> None:
    import hp_rewrite.match.analysis as rewrite
    from hp_rewrite.plan import DEFAULT_PLAN

    with torch.device("meta"):
        model = _Model(lambda: _RoutedBlock(_WrongMathExperts()))
    real = rewrite.analyze_block

    def broken(path, block, name):
        if path == "layers.1":
            raise RuntimeError("no structure")
        return real(path, block, name)

    def no_probe(*args, **kwargs):
        raise ValueError("no probe")

    monkeypatch.setattr(rewrite, "analyze_block", broken)
    monkeypatch.setattr(rewrite, "choose_archetype", no_probe)
    with pytest.raises(ValueError, match="no probe"):
        rewrite.analyze(model, DEFAULT_PLAN)
    analysis = rewrite.analyze(model, DEFAULT_PLAN, collect_errors=True)
    assert [f.path for f in analysis.failed] == ["layers.1.experts"]
    assert analysis.failed[0].reason == "the structure analysis raised RuntimeError: no structure"
    assert [r.structure.path for r in analysis.unmatched] == ["layers.0", "layers.2"]
    assert analysis.unmatched[0].reason == "the archetype probe raised ValueError: no probe"
    doc = describe(model, None)
    assert [f["kind"] for f in doc["non_contract"]] == ["not-a-holder"]
    assert only_group(doc)["reason"] == "the archetype probe raised ValueError: no probe"
