"""Tiny models built from transformers configs: shrink, build, forward, checkpoint, reload.

The eight families the project targets are checked one by one; every other MoE model type the
installed transformers has (found by structure, ``moe_model_types``) is swept in one test. A reload
must give bit-identical logits. Checkpoint tensors are memory-mapped with an 8-byte alignment and
CPU GEMM kernels pick vectorised paths by alignment (1-ulp differences in ``grouped_mm``), so the
reloaded tensors are copied into fresh storage before the comparison (``_fresh``).
"""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from hp_rewrite.hf import auto_class_for
from hp_rewrite.tiny import (
    TinyError,
    build_tiny_model,
    experts_holders,
    make_tiny,
    moe_model_types,
    sample_input_ids,
    survey_model_types,
    tiny_config,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread, and a busy machine stalls OpenMP barriers (a 64x64
    matmul then waits a whole time slice): pin one thread for this module, restore afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


REQUIRED = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "deepseek_v2", "gpt_oss"]
TOP_K_NAMES = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_k",
    "moe_topk",
    "moe_top_k",
    "top_k_experts",
)


def _walk(cfg):
    yield cfg
    for value in vars(cfg).values():
        if isinstance(value, PreTrainedConfig):
            yield from _walk(value)


def _top_ks(cfg) -> set[int]:
    return {getattr(c, n) for c in _walk(cfg) for n in TOP_K_NAMES if n in vars(c) and getattr(c, n)}


def _forward(model, cfg) -> torch.Tensor | None:
    """The model's main output on plain token ids [2, 8] (seeded: some forwards sample noise), or
    None for a model that takes no token ids (a vision encoder)."""
    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params:
        return None
    ids = sample_input_ids(cfg, batch=2, seq=8)
    kwargs = {"decoder_input_ids": ids} if getattr(cfg, "is_encoder_decoder", False) else {}
    if "use_cache" in params:  # one forward needs no cache (transformers 5.25's hybrid Nemotron caches fail to start)
        kwargs["use_cache"] = False
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            out = model(input_ids=ids, **kwargs)
        except AttributeError:  # a talker fed by another model's embeddings: no table for its own ids
            if "inputs_embeds" not in params:
                raise
            hidden = cfg.get_text_config().hidden_size
            embeds = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(0))
            out = model(inputs_embeds=embeds, **kwargs)
    for key in ("logits", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    return out[0]


def _fresh(model):
    for p in list(model.parameters()) + list(model.buffers()):
        p.data = p.data.clone()
    return model


# transformers faults on reload (the checkpoint is written, the reload gives other weights): checked up
# to the reload, the weight comparison is left out. The standalone Qwen3-Omni talker (5.24): its fused
# experts are saved under their own names, and from_pretrained reports nothing missing yet loads other
# values for gate_up_proj/down_proj.
RELOAD_FAULTS = {"qwen3_omni_moe_talker_text"}


def _check_family(model_type: str, tmp_path, strict_top_k: bool) -> None:
    cfg = tiny_config(model_type)
    model = build_tiny_model(cfg, seed=0)
    assert not model.training and next(model.parameters()).dtype == torch.float32
    holders = experts_holders(model)
    assert any(n == 8 for _, _, n in holders), f"{model_type}: no MoE layer with 8 experts: {holders}"
    top_ks = _top_ks(cfg)
    if strict_top_k:
        assert top_ks == {2}, f"{model_type}: top-k {top_ks}"
    else:  # a family that rejects top-k 2 keeps its own
        assert 2 in top_ks or top_ks <= _top_ks(AutoConfig.for_model(model_type)), top_ks

    out = _forward(model, cfg)
    if out is not None:
        assert bool(torch.isfinite(out).all()), f"{model_type}: non-finite output"

    path = make_tiny(model_type, tmp_path / model_type, seed=0)
    files = os.listdir(path)
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files), files
    with open(path / "config.json") as f:
        assert json.load(f)["model_type"] == model.config.model_type
    for name in (f for f in files if f.endswith(".safetensors")):
        with safe_open(str(path / name), framework="pt") as f:
            assert len(list(f.keys())) > 0

    loader = auto_class_for(cfg)
    reloaded = _fresh(loader.from_pretrained(str(path), attn_implementation="eager").eval())
    assert type(reloaded) is type(model)
    if model_type in RELOAD_FAULTS:
        return
    state, state2 = model.state_dict(), reloaded.state_dict()
    assert state.keys() == state2.keys()
    assert all(torch.equal(state[k], state2[k]) for k in state), f"{model_type}: weights differ after reload"
    if out is not None:
        assert torch.equal(out, _forward(reloaded, cfg)), f"{model_type}: logits differ after reload"


@pytest.mark.parametrize("model_type", REQUIRED)
def test_required_family(model_type, tmp_path):
    _check_family(model_type, tmp_path, strict_top_k=True)
    assert auto_class_for(tiny_config(model_type)) is AutoModelForCausalLM


def test_sweep_every_moe_type(tmp_path):
    """Every MoE model type found by structure builds, runs, saves and reloads bit-identically."""
    found = moe_model_types()
    assert isinstance(found, list) and found == sorted(found) and len(found) >= 60
    assert set(REQUIRED) <= set(found)
    assert {"llama4", "switch_transformers", "nllb-moe", "jetmoe", "longcat_flash"} <= set(found)
    assert "llama" not in found and "bert" not in found  # dense models are never candidates
    failures = {}
    for model_type in found:
        if model_type in REQUIRED:
            continue  # checked one by one above
        try:
            _check_family(model_type, tmp_path, strict_top_k=False)
        except Exception as e:  # collect, report all at once
            failures[model_type] = f"{type(e).__name__}: {e}"[:300]
    assert not failures, failures


# MoE families of transformers 5.24 whose tiny model could not be built: a transformers config bug (dbrx,
# qwen3_omni_moe talker: now filled in by FAMILY_DEFAULTS), a missing optional dependency
# (inkling_mm_model: scipy, in the test extra). Without scipy inkling_mm_model still fails cleanly.
KNOWN_FAILURES = ["dbrx", "qwen3_omni_moe", "qwen3_omni_moe_talker_text", "inkling_mm_model"]


def test_families_that_cannot_be_built_fail_cleanly():
    for s in survey_model_types(KNOWN_FAILURES):
        assert s.status in ("error", "moe"), s
        if s.status == "error":
            assert s.model_type in s.detail
            with pytest.raises(TinyError):
                build_tiny_model(s.model_type, device="meta")


def test_shrink_rules_and_fixups():
    cfg = tiny_config("deepseek_v3")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.max_position_embeddings) == (
        64,
        2,
        128,
        128,
    )
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert (cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace) == (2, 1, 1)
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 4  # MLA: no grouped key/value heads
    assert cfg.qk_head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q2 = tiny_config("qwen2_moe")  # multi-head attention stays multi-head
    assert (q2.shared_expert_intermediate_size, q2.num_key_value_heads, q2.mlp_only_layers) == (48, 4, [])
    q3 = tiny_config("qwen3_moe")  # grouped-query attention: 4 heads, 2 key/value heads
    assert (q3.num_attention_heads, q3.num_key_value_heads, q3.moe_intermediate_size) == (4, 2, 32)
    g = tiny_config("gpt_oss")
    assert len(g.layer_types) == 2 and set(g.layer_types) == {"sliding_attention", "full_attention"}
    # per-layer MLP list: one dense and one sparse layer kept
    d = tiny_config("deepseek_v32")
    assert sorted(d.mlp_layer_types) == ["dense", "sparse"]
    # special token ids stay inside the tiny vocabulary
    vl = tiny_config("qwen3_vl_moe")
    ids = {n: getattr(c, n) for c in _walk(vl) for n in vars(c) if n.endswith(("_token_id", "_token_index"))}
    assert ids["image_token_id"] >= 64 and ids["video_token_id"] >= 64
    assert all(0 <= v < 128 for v in ids.values() if isinstance(v, int)), ids
    assert (
        vl.vision_config.depth == 2 and vl.vision_config.out_hidden_size == vl.text_config.hidden_size == 64
    )


def test_tiny_config_of_an_existing_config(tmp_path):
    big = AutoConfig.for_model("qwen3_moe")
    small = tiny_config(big)
    assert small is not big and big.hidden_size > 64 and small.hidden_size == 64
    assert small.num_experts == 8 and small.num_experts_per_tok == 2


def test_make_tiny_from_config_dir(tmp_path):
    AutoConfig.for_model("mixtral").save_pretrained(tmp_path / "src")
    out = make_tiny(None, tmp_path / "out", seed=1, from_config=tmp_path / "src")
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "mixtral" and cfg.hidden_size == 64 and cfg.num_local_experts == 8
    with pytest.raises(TinyError, match="exactly one"):
        make_tiny("mixtral", tmp_path / "x", from_config=tmp_path / "src")
    with pytest.raises(TinyError, match="no config.json"):
        make_tiny(None, tmp_path / "y", from_config=tmp_path / "out" / "nothing")


def test_make_tiny_refuses_non_empty_dir_and_leaves_no_temp(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(TinyError, match="not an empty directory"):
        make_tiny("olmoe", out)
    assert os.listdir(out) == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_tiny("olmoe", empty) == empty and (empty / "config.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "empty"]  # the temporary directory was renamed away


def test_unknown_model_type_lists_close_matches():
    with pytest.raises(TinyError, match="close matches: .*qwen3_moe"):
        tiny_config("qwen3moe")
    with pytest.raises(TinyError, match="unknown model type"):
        make_tiny("no_such_family_xyz", "/nonexistent/never-written")


def test_config_bug_gives_tiny_error():
    # dbrx: DbrxAttentionConfig has no rope_theta, the model reads it (transformers 5.24 config bug; the
    # shrinker fills it in from FAMILY_DEFAULTS, so it is taken out again here)
    cfg = tiny_config("dbrx")
    del cfg.attn_config.rope_theta
    with pytest.raises(TinyError, match="dbrx: the tiny model cannot be built"):
        build_tiny_model(cfg)


def test_family_defaults_fill_what_the_modeling_code_reads():
    """Fields transformers' modeling code reads but the default config lacks (dbrx's attention config,
    the Qwen3-Omni talker) are filled in, so these families build."""
    dbrx = tiny_config("dbrx")
    assert dbrx.attn_config.rope_theta == 500000.0 and dbrx.attn_config.clip_qkv == 8.0
    talker = tiny_config("qwen3_omni_moe_talker_text")
    assert talker.shared_expert_intermediate_size == 48  # filled, then shrunk by the table
    omni = tiny_config("qwen3_omni_moe")
    assert omni.talker_config.spatial_merge_size == 2
    assert [n for _, _, n in experts_holders(build_tiny_model(dbrx, device="meta"))] == [8, 8]


def test_build_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_tiny_model("qwen3_moe", seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_tiny_model("qwen3_moe", seed=3)
    c = build_tiny_model("qwen3_moe", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_routers_are_randomised():
    model = build_tiny_model("deepseek_v3", seed=0)
    block = model.model.layers[1].mlp
    assert block.gate.weight.std() > 0.1  # N(0, 0.2), not the 0.02 init
    assert block.gate.e_score_correction_bias.abs().max() > 0
    ids = sample_input_ids(model.config, batch=4, seq=16)
    with torch.no_grad():
        h = model.model.embed_tokens(ids).reshape(-1, 64)
        _, chosen = torch.topk(h @ block.gate.weight.t(), 2, dim=-1)
    assert chosen.unique().numel() >= 4  # routing spreads over experts


def test_expert_weights_left_uninitialised_are_drawn():
    """The Qwen3-Omni talker's _init_weights skips its experts (torch.empty): the builder draws them, so
    the tiny model is finite and the same on every build."""
    a, b = (build_tiny_model("qwen3_omni_moe_talker_text", seed=0).state_dict() for _ in range(2))
    experts = [k for k in a if ".mlp.experts." in k]
    assert experts and all(torch.isfinite(a[k]).all() and a[k].abs().max() > 1e-3 for k in experts)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.are_deterministic_algorithms_enabled()  # the build restores torch's settings
