"""The archetype probe with narrowed experts: small, the same archetype as at full width, as strict.

``choose_archetype`` confirms an archetype on a random-weight copy of the block whose experts'
intermediate width is narrowed (``narrow_probe``); a full-width copy of a big model's layer can
exceed a rank's share of the model. These tests check that the narrow copy really is small (built
from a meta-device block whose full-width experts are never allocated), that it picks the archetype
the full-width probe picks on blocks of different weight layouts, that a wrong generated forward is
still rejected on it, and that a block the narrowing breaks falls back to the full width.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hp_rewrite.match import archetype as archetype_module
from hp_rewrite.match import choose_archetype, experts_layout, find_blocks
from hp_rewrite.match.archetype import PROBE_TOL, narrow_probe
from hp_rewrite.runtime.compute.experts import ExpertsLayout
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests import ep_cases


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _meta_qwen3_block(moe_intermediate: int):
    config = tiny_config("qwen3_moe")
    config.moe_intermediate_size = moe_intermediate
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return find_blocks(model)[0]


def test_narrow_probe_has_narrow_experts_and_is_small() -> None:
    s = _meta_qwen3_block(512)
    H, E = s.hidden_size, s.num_experts  # noqa: N806 - the usual MoE size names
    probe, width = narrow_probe(s)
    assert width == 16
    experts = getattr(probe, s.experts_name)
    assert tuple(experts.gate_up_proj.shape) == (E, 2 * width, H)
    assert tuple(experts.down_proj.shape) == (E, H, width)
    assert experts.intermediate_dim == width
    assert not any(t.is_meta for t in probe.parameters())
    # the router keeps its size; the meta block it came from is untouched
    assert tuple(getattr(probe, s.router_name).weight.shape) == (E, H)
    assert tuple(s.experts.down_proj.shape) == (E, H, 512) and s.experts.down_proj.is_meta
    assert s.experts.intermediate_dim == 512
    full = _bytes(s.block)  # meta tensors: the size a full-width probe would allocate
    assert full == 4 * (E * H + E * 3 * 512 * H)
    assert _bytes(probe) < full / 20, (_bytes(probe), full)


def test_narrow_width_keeps_the_layout_read_from_shapes() -> None:
    # GPT-OSS experts ([E, in, out], interleaved gate/up, biases) without the is_transposed flag:
    # the transposition is read from the shapes; with hidden 32, width 16 (2 * 16 == H) is skipped
    config = tiny_config("gpt_oss")
    config.hidden_size, config.intermediate_size = 32, 64
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    (s, *_) = find_blocks(model)
    del s.experts.is_transposed
    layout = experts_layout(s.experts)
    assert layout.transposed and layout.up_bias
    probe, width = narrow_probe(s)
    experts = getattr(probe, s.experts_name)
    assert width == 24 and experts.intermediate_size == 24
    assert experts_layout(experts) == layout
    assert tuple(experts.gate_up_proj.shape) == (s.num_experts, 32, 48)
    assert tuple(experts.gate_up_proj_bias.shape) == (s.num_experts, 48)
    assert tuple(experts.down_proj.shape) == (s.num_experts, 24, 32)
    assert tuple(experts.down_proj_bias.shape) == (s.num_experts, 32)


def test_small_expert_width_is_not_narrowed() -> None:
    s = _meta_qwen3_block(12)
    assert narrow_probe(s) is None
    r = choose_archetype(s)
    assert r.probe_width is None and r.archetype is not None


def _blocks(family: str):
    if family in ("separate", "w1w3w2_transposed"):
        return find_blocks(ep_cases.build_block(family))
    return find_blocks(build_tiny_model(tiny_config(family), seed=0))


# fused (gated shared, sigmoid routing), fused-interleaved-transposed-bias, up-only, separate weights
LAYOUT_FAMILIES = [
    "qwen3_moe",
    "qwen2_moe",
    "deepseek_v3",
    "gpt_oss",
    "nemotron_h",
    "separate",
    "w1w3w2_transposed",
]


@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_narrow_probe_picks_the_full_width_archetype(family: str, monkeypatch) -> None:
    s = _blocks(family)[0]
    narrow = choose_archetype(s)
    assert narrow.probe_width is not None and narrow.archetype is not None, narrow.tried
    monkeypatch.setattr(archetype_module, "narrow_probe", lambda *a, **k: None)
    full = choose_archetype(s)
    assert full.probe_width is None
    assert narrow.archetype == full.archetype  # level, router, shared, layout, names and constants
    assert narrow.tried == full.tried


def _scaled(fn, factor: float):
    def wrong(*args, **kwargs):
        out = fn(*args, **kwargs)
        return (out[0] * factor, *out[1:]) if isinstance(out, tuple) else out * factor

    return wrong


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_generated_code_off_by_more_than_the_tolerance_is_rejected(family: str, monkeypatch) -> None:
    s = _blocks(family)[0]
    compile_function = archetype_module.compile_function

    def compile_scaled(factor: float):
        return lambda source, name: _scaled(compile_function(source, name), factor)

    monkeypatch.setattr(archetype_module, "compile_function", compile_scaled(1 + 0.1 * PROBE_TOL))
    assert choose_archetype(s).archetype is not None  # the wrapper itself changes nothing that matters
    monkeypatch.setattr(archetype_module, "compile_function", compile_scaled(1 + 10 * PROBE_TOL))
    r = choose_archetype(s)
    assert r.probe_width is not None
    assert r.archetype is None, r.archetype
    assert "output differs (rel err 1.00e-04)" in r.reason and "differs from the original" in r.reason


def test_runtime_that_misses_the_down_bias_is_rejected_on_the_narrow_probe(monkeypatch) -> None:
    s = _blocks("gpt_oss")[0]
    read = ExpertsLayout.of
    monkeypatch.setattr(ExpertsLayout, "of", classmethod(lambda cls, m: replace(read(m), down_bias=None)))
    r = choose_archetype(s)
    assert r.probe_width == 16
    assert r.archetype is None, r.archetype
    assert "output differs" in r.reason and "differs from the original" in r.reason, r.reason


class _FixedWidthExperts(ep_cases.SeparateExperts):
    """Reads its width from an attribute the probe does not know about (a narrow copy breaks it)."""

    def __init__(self):
        super().__init__()
        self.hidden_units = ep_cases.I

    def forward(self, hidden, top_k_index, top_k_weights):
        self.down_proj.view(self.num_experts, ep_cases.H, self.hidden_units)
        return super().forward(hidden, top_k_index, top_k_weights)


def test_block_the_narrowing_breaks_is_probed_at_full_width() -> None:
    blk = ep_cases.build_block("separate")
    blk.experts = _FixedWidthExperts()
    (s,) = find_blocks(blk)
    assert narrow_probe(s) is not None
    r = choose_archetype(s)
    assert r.probe_width is None
    assert r.archetype == choose_archetype(find_blocks(ep_cases.build_block("separate"))[0]).archetype, (
        r.reason
    )
    assert any("probed at full width" in t for t in r.tried), r.tried
