"""Shrinking a transformers config to a tiny one that keeps its MoE code paths (nothing is downloaded).

``tiny_config`` shrinks any transformers config (a model type name, or a config object such as one
read from a checkpoint directory) to a model small enough for a CPU test:

* Every size comes from one table, :data:`SHRINK_RULES`, of ``(attribute, value)`` pairs, applied to
  the config and, recursively, to every sub-config (``text_config``, ``vision_config``, ...) that
  *has* the attribute (``attribute_map`` aliases count). Lists of numbers (per-modality sizes) get
  the value element-wise; attributes in :data:`KEEP_OFF` that are ``None`` or 0 stay so (a feature
  that is off, e.g. ``q_lora_rank`` in DeepSeek-V2-Lite). Per-layer overrides of heterogeneous
  configs (``per_layer_config``) are shrunk by the same table.
* Then a few fix-ups restore what the table cannot express (each a small function below):
  per-layer lists (``layer_types``, ``mlp_layer_types``, hybrid patterns, ...) keep the entries of
  the layers picked to cover an MoE layer, an attention layer and as many other kinds as fit, and
  layer-index lists (``moe_layers``, ``mlp_only_layers``, ...) are renumbered to them; per-layer
  lists a default config leaves ``None`` are filled in; an all-linear hybrid gets one attention
  layer; multi-head attention stays multi-head and MLA gets as many key/value heads as query heads
  with ``head_dim`` tied to the same MLA size as before; M-RoPE sections are rescaled to the new
  rotary size; backbone stage names follow the layer count; special token ids move to the top of
  the 128-token vocabulary (ids below :data:`TEXT_TOKEN_LIMIT` are plain text tokens). Values that
  modeling code hard-codes when the config lacks them are filled in first (:data:`FAMILY_DEFAULTS`,
  the only per-family data). When a family rejects top-k 2, it keeps its own top-k.

The tiny *model* (built, routers randomised, written as a checkpoint) is :mod:`hp_rewrite.tiny`.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from ..errors import UserError
from .config import config_mapping, is_config
from .logs import quiet_transformers, short_error

__all__ = [
    "FAMILY_DEFAULTS",
    "KEEP_OFF",
    "SHRINK_RULES",
    "TEXT_TOKEN_LIMIT",
    "VOCAB",
    "TinyError",
    "default_config",
    "sub_configs",
    "tiny_config",
]


class TinyError(UserError, ValueError):
    """A tiny config or model that cannot be made: unknown model type, a config or model that fails
    to build, an output directory that is not empty. The message names the model type and the cause."""


HIDDEN = 64
LAYERS = 2
EXPERTS = 8
TOP_K = 2
VOCAB = 128
#: Special token ids are moved into ``[TEXT_TOKEN_LIMIT, VOCAB)``; ids below are plain text tokens.
TEXT_TOKEN_LIMIT = 64

# fmt: off
#: The shrink table: ``(attribute, value)``; a rule applies only where the attribute exists
#: (on the config or any sub-config; config ``attribute_map`` aliases count).
SHRINK_RULES: tuple[tuple[str, Any], ...] = (
    # widths
    ("hidden_size", HIDDEN), ("d_model", HIDDEN), ("n_embd", HIDDEN), ("embed_dim", HIDDEN),
    ("out_hidden_size", HIDDEN), ("text_hidden_size", HIDDEN), ("thinker_hidden_size", HIDDEN),
    ("vision_hidden_size", HIDDEN), ("projector_hidden_size", HIDDEN), ("projection_hidden_size", HIDDEN),
    ("projection_hidden_dim", HIDDEN), ("projection_intermediate_size", HIDDEN),
    ("vision_output_dim", HIDDEN), ("projector_input_dim", HIDDEN), ("projector_output_dim", HIDDEN),
    ("adapter_in_dim", HIDDEN), ("adapter_out_dim", HIDDEN), ("output_dim", HIDDEN),
    ("hidden_size_per_layer_input", 16), ("moe_hidden_size", 32), ("moe_latent_size", 32),
    ("audio_hidden_size", HIDDEN), ("adapter_input_size", HIDDEN), ("part_features", 16),
    ("router_hidden_size", 32),
    # depth
    ("num_hidden_layers", LAYERS), ("num_layers", LAYERS), ("n_layers", LAYERS), ("depth", LAYERS),
    ("encoder_layers", LAYERS), ("decoder_layers", LAYERS), ("num_decoder_layers", LAYERS),
    # attention
    ("num_attention_heads", 4), ("num_heads", 4), ("n_heads", 4), ("n_head", 4),
    ("encoder_attention_heads", 4), ("decoder_attention_heads", 4),
    ("num_key_value_heads", 2), ("head_dim", 16), ("d_kv", 16), ("kv_channels", 16),
    ("swa_num_attention_heads", 4), ("swa_num_key_value_heads", 2), ("swa_head_dim", 16),
    # multi-head latent attention (DeepSeek-V2/V3 family) and sparse-attention indexers
    ("q_lora_rank", 32), ("kv_lora_rank", 16), ("qk_rope_head_dim", 8), ("qk_nope_head_dim", 16),
    ("v_head_dim", 16), ("qk_head_dim", 24), ("o_lora_rank", 32),
    ("index_n_heads", 2), ("index_head_dim", 16), ("index_topk", 4), ("index_kpool", 2),
    ("indexer_n_heads", 2), ("indexer_kv_heads", 1), ("indexer_head_dim", 16), ("indexer_budget", 8),
    ("indexer_compress_ratio", 4),
    # linear-attention mixers (gated delta net, KDA, ...)
    ("linear_num_heads", 4), ("linear_head_dim", 16), ("linear_num_key_heads", 2), ("linear_num_value_heads", 4),
    ("linear_key_head_dim", 16), ("linear_value_head_dim", 16),
    # state-space mixers (hybrid models): heads * head size == expand * hidden size
    ("mamba_n_heads", 8), ("mamba_d_head", 16), ("mamba_expand", 2), ("mamba_d_state", 16),
    ("mamba_num_heads", 8), ("mamba_head_dim", 16), ("ssm_state_size", 16), ("mamba_chunk_size", 16),
    # dense MLP sizes
    ("intermediate_size", 32), ("ffn_hidden_size", 32), ("d_ff", 32), ("encoder_ffn_dim", 32),
    ("decoder_ffn_dim", 32), ("intermediate_size_mlp", 32), ("dense_intermediate_size", 32),
    ("prefix_dense_intermediate_size", 32),
    # routed experts: count, top-k, expert intermediate size
    ("num_experts", EXPERTS), ("num_local_experts", EXPERTS), ("n_routed_experts", EXPERTS),
    ("moe_num_experts", EXPERTS),
    ("num_experts_per_tok", TOP_K), ("num_experts_per_token", TOP_K), ("moe_k", TOP_K),
    ("moe_topk", TOP_K), ("moe_top_k", TOP_K), ("top_k_experts", TOP_K),
    ("moe_intermediate_size", 32), ("expert_ffn_hidden_size", 32),
    ("zero_expert_num", 2), ("expert_capacity", 32),
    # shared experts
    ("shared_expert_intermediate_size", 48), ("moe_shared_expert_intermediate_size", 48),
    ("shared_intermediate_size", 48), ("shared_experts_intermediate_size", 48), ("share_expert_dim", 48),
    ("n_shared_experts", 1), ("num_shared_experts", 1), ("moe_num_shared_experts", 1),
    # grouped routing
    ("n_group", 2), ("num_expert_group", 2), ("topk_group", 1),
    # which layers are MoE (see also the per-layer list fix-up)
    ("first_k_dense_replace", 1), ("num_dense_layers", 1), ("mlp_only_layers", []),
    ("decoder_sparse_step", 1), ("encoder_sparse_step", 1), ("interleave_moe_layer_step", 1),
    ("expert_layer_period", 2), ("expert_layer_offset", 1), ("attn_layer_period", 2), ("attn_layer_offset", 0),
    ("moe_layer_start_index", 1), ("moe_layer_end_index", LAYERS - 1), ("moe_layer_interval", 1),
    ("num_sparse_encoder_layers", 1), ("num_sparse_decoder_layers", 1),
    ("enable_moe_block", True), ("is_moe", True),
    # vocabulary and positions
    ("vocab_size", VOCAB), ("unpadded_vocab_size", VOCAB), ("vocab_size_per_layer_input", VOCAB),
    ("max_position_embeddings", 128),
    # a window wider than any test sequence: masks are built, nothing is cut (None -> a window too:
    # some models build a sliding mask unconditionally)
    ("sliding_window", 64),
)
# fmt: on

#: Attributes that stay ``None`` (or 0) when ``None`` (or 0): that switches an optional feature off.
KEEP_OFF = frozenset(
    {
        "q_lora_rank",
        "qk_rope_head_dim",
        "o_lora_rank",
        "moe_latent_size",
        "hidden_size_per_layer_input",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "prefix_dense_intermediate_size",
        "router_hidden_size",
        "moe_hidden_size",
        "dense_intermediate_size",
        "intermediate_size_mlp",
        "projection_intermediate_size",
    }
)

#: Values some modeling code hard-codes when the config does not carry them (so the table cannot
#: shrink them): ``{model_type: {attribute or "dict_attribute.key": value}}``, filled in before the
#: table is applied, then shrunk like any other value. The only per-family data in this module.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # M-RoPE over (temporal, height, width) with head_dim 128, partial rotary 0.5 / full rotary
    "glm4v_moe_text": {"rope_parameters.mrope_section": [8, 12, 12]},
    "ernie4_5_vl_moe_text": {"rope_parameters.mrope_section": [22, 22, 20]},
    # read by the modeling code but absent from the default config (real checkpoints carry them):
    # DbrxAttention reads attn_config.rope_theta and clamps q/k/v with attn_config.clip_qkv unconditionally
    # (dbrx-instruct: 500000 and 8); the talker's MoE block reads its shared-expert size
    "dbrx": {"attn_config.rope_theta": 500000.0, "attn_config.clip_qkv": 8.0},
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": 768},
    "qwen3_omni_moe": {"talker_config.spatial_merge_size": 2},  # the talker model reads it from its own config
}

# Attributes that count a model's layers, in order of preference (used by the per-layer fix-ups).
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layers", "depth", "decoder_layers", "encoder_layers")
# Values that mark a per-layer MLP entry as sparse (MoE) or dense.
_SPARSE_MARKS = ("sparse", "moe")


# ----------------------------------------------------------------------------------------------
# configs


def default_config(model_type: str):
    """The default config of a model type (its config class built with no arguments, quietly)."""
    mapping = config_mapping()
    if model_type not in mapping:
        close = difflib.get_close_matches(model_type, list(mapping.keys()), n=5, cutoff=0.5)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise TinyError(f"unknown model type {model_type!r} in transformers{hint}")
    try:
        with quiet_transformers():
            return mapping[model_type]()
    except Exception as e:  # a config class whose defaults do not validate
        raise TinyError(f"{model_type}: its default config cannot be built: {short_error(e)}") from e


def sub_configs(cfg) -> Iterator[tuple[str, Any]]:
    """``(attribute, config)`` of every sub-config (``text_config``, ``vision_config``...) of ``cfg``."""
    for key, value in list(vars(cfg).items()):
        if is_config(value):
            yield key, value


def _has_attr(cfg, name: str) -> bool:
    return name in vars(cfg) or name in type(cfg).attribute_map


def _layer_count(cfg) -> tuple[str, int, bool] | None:
    """``(name, count, settable)`` of the attribute that counts a config's layers; a count that is
    a read-only property (derived from a per-layer list) is not settable."""
    for name in _LAYER_COUNTS:
        settable = _has_attr(cfg, name)
        try:
            value = getattr(cfg, name) if settable or hasattr(type(cfg), name) else None
        except Exception:
            value = None
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value, settable
    return None


_UNCHANGED = object()


def _shrunk_value(name: str, old: Any, value: Any, skip: frozenset[str]) -> Any:
    """The value rule ``(name, value)`` gives an attribute that holds ``old``, or ``_UNCHANGED``."""
    if name in skip or ((old is None or old == 0) and name in KEEP_OFF):
        return _UNCHANGED
    if isinstance(old, bool) and not isinstance(value, bool):
        return _UNCHANGED  # a flag that shares a name with a size
    if isinstance(old, (list, tuple)) and not isinstance(value, (list, tuple)):
        if old and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in old):
            return type(old)(value for _ in old)  # e.g. per-modality sizes [text, vision]
        return _UNCHANGED
    return copy.deepcopy(value)


def _apply_rules(cfg, skip: frozenset[str]) -> None:
    for name, value in SHRINK_RULES:
        if _has_attr(cfg, name):
            new = _shrunk_value(name, getattr(cfg, name), value, skip)
            if new is not _UNCHANGED:
                setattr(cfg, name, new)


def _shrink_overrides(cfg, overrides: dict[int, dict[str, Any]], keep: list[int], before, skip) -> dict:
    """Per-layer overrides of a heterogeneous config, for the layers kept (renumbered), shrunk by
    the same table and the attention fix-ups (on the layer's view: global values overlaid with its
    overrides); overrides equal to the shrunk global value are dropped."""
    rules = dict(SHRINK_RULES)
    glob = {k: v for k, v in vars(cfg).items() if not k.startswith("_") and not is_config(v)}
    out = {}
    for layer, orig in enumerate(keep):
        attrs = overrides.get(orig, {})
        kept = {}
        for name, old in attrs.items():
            new = _shrunk_value(name, old, rules[name], skip) if name in rules else _UNCHANGED
            kept[name] = old if new is _UNCHANGED else new
        view = SimpleNamespace(**copy.deepcopy({**glob, **kept}))
        _fix_attention(view, {**before, **attrs})
        # what differs from the global values: the overrides, and sizes the fix-ups changed
        kept = {
            k: v
            for k, v in vars(view).items()
            if k == "skip" or (v != glob.get(k) and (k in attrs or k != "rope_parameters"))
        }
        if kept:
            out[layer] = kept
    return out


def _is_index_list(name: str, value: Any) -> bool:
    """A list of layer indices (``moe_layers``, ``mlp_only_layers``, ``deepstack_visual_indexes``):
    named so, integers, strictly increasing (a per-layer 0/1 list such as ``no_rope_layers`` is not)."""
    if name.startswith("_") or not isinstance(value, (list, tuple)) or not value or not _ints(*value):
        return False
    if not re.search(r"(layers|indexes|indices|layer_ids|layer_idx)$", name):
        return False
    return all(a < b for a, b in zip(value[:-1], value[1:], strict=True)) and value[0] >= 0


def _select_layers(per_layer: list[list], old: int, n: int) -> list[int]:
    """The ``n`` original layers the tiny model keeps (in order): chosen greedily to cover the kinds
    named in the per-layer lists, a sparse (MoE) kind and an attention kind (other than linear
    attention) first, then every other kind; ties go to the lowest layer index."""
    kinds: dict[str, set[int]] = {}
    for values in per_layer:
        for i, v in enumerate(values):
            if isinstance(v, str):
                kinds.setdefault(v, set()).add(i)
    weight = {k: 1 for k in kinds}
    for k in [k for k in kinds if k in _SPARSE_MARKS][:1]:
        weight[k] = 4
    for k in [k for k in kinds if k.endswith("attention") and k != "linear_attention"][:1]:
        weight[k] = 2
    chosen: list[int] = []
    covered: set[str] = set()
    while len(chosen) < n:

        def gain(i: int) -> int:
            return sum(w for k, w in weight.items() if k not in covered and i in kinds[k])

        best = max((i for i in range(old) if i not in chosen), key=lambda i: (gain(i), -i))
        chosen.append(best)
        covered.update(k for k in kinds if best in kinds[k])
    return sorted(chosen)


def _ensure_attention_layer(cfg) -> None:
    """A hybrid model whose layer types are all linear (state-space) mixers gets one full-attention
    layer (the first): transformers' caches need one, and the tiny model covers both mixers."""
    types = vars(cfg).get("layer_types")
    if isinstance(types, list) and len(types) > 1 and all(isinstance(t, str) for t in types):
        if "linear_attention" in types and not any(
            t.endswith("attention") and t != "linear_attention" for t in types
        ):
            cfg.layer_types = ["full_attention"] + types[1:]


def _fix_layers(cfg, old_layers: int | None) -> list[int] | None:
    """Per-layer lists (and one-character-per-layer patterns) keep the entries of the layers
    :func:`_select_layers` picks; layer-index lists are renumbered to them (an emptied ``*moe*``
    list gets the last layer). A config whose layer count is derived from a per-layer list gets
    :data:`LAYERS` entries. Returns the original index of each kept layer."""
    count = _layer_count(cfg)
    if count is None or old_layers is None:
        return None
    n = count[1] if count[2] else min(LAYERS, old_layers)
    if old_layers <= n:
        return list(range(old_layers))
    lists = {
        name: value
        for name, value in vars(cfg).items()
        if not name.startswith("_")
        and name not in _LAYER_COUNTS
        and not _is_index_list(name, value)
        and (
            (isinstance(value, (list, tuple)) and len(value) == old_layers)
            or (isinstance(value, str) and len(value) == old_layers and name.endswith("pattern"))
        )
    }
    keep = _select_layers([list(v) for v in lists.values()], old_layers, n)
    for name, value in lists.items():
        picked = [value[i] for i in keep]
        setattr(cfg, name, "".join(picked) if isinstance(value, str) else picked)
    for name, value in list(vars(cfg).items()):
        if name in lists or not _is_index_list(name, value):
            continue
        kept = [new for new, orig in enumerate(keep) if orig in set(value)]
        if not kept and "moe" in name:
            kept = [n - 1]
        if kept != list(value):
            setattr(cfg, name, type(value)(kept) if isinstance(value, tuple) else kept)
    return keep


def _fix_attention(cfg, before: dict[str, Any]) -> None:
    """Relations between head counts and head sizes that the table cannot express."""
    heads, kv = before.get("num_attention_heads"), before.get("num_key_value_heads")
    mla = bool(vars(cfg).get("kv_lora_rank"))
    # multi-head (not grouped) attention stays so; MLA repeats no key/value heads either
    if "num_key_value_heads" in vars(cfg) and isinstance(cfg.num_attention_heads, int):
        if mla or (isinstance(heads, int) and heads == kv):
            cfg.num_key_value_heads = cfg.num_attention_heads
    if mla:
        if before.get("qk_nope_head_dim") == before.get("qk_rope_head_dim") and "qk_nope_head_dim" in vars(
            cfg
        ):
            cfg.qk_nope_head_dim = cfg.qk_rope_head_dim  # equal parts stay equal (partial rotary 0.5)
        nope, rope_dim = vars(cfg).get("qk_nope_head_dim"), vars(cfg).get("qk_rope_head_dim")
        if "qk_head_dim" in vars(cfg) and isinstance(nope, int) and isinstance(rope_dim, int):
            cfg.qk_head_dim = nope + rope_dim
        # head_dim is one of the MLA sizes (or their sum): keep the same one
        old, b_nope, b_rope = (
            before.get("head_dim"),
            before.get("qk_nope_head_dim"),
            before.get("qk_rope_head_dim"),
        )
        total = (b_nope + b_rope, nope + rope_dim) if _ints(b_nope, b_rope, nope, rope_dim) else (None, None)
        pairs = [(before.get(k), vars(cfg).get(k)) for k in ("qk_rope_head_dim", "qk_head_dim", "v_head_dim")]
        for was, now in [*pairs[:2], total, *pairs[2:]]:
            if "head_dim" in vars(cfg) and old is not None and was == old and isinstance(now, int):
                cfg.head_dim = now
                break
    # M-RoPE sections must add up to half the rotary dimension
    rope = vars(cfg).get("rope_parameters")
    head_dim = vars(cfg).get("head_dim")
    if not isinstance(head_dim, int) and isinstance(vars(cfg).get("hidden_size"), int):
        head_dim = cfg.hidden_size // max(1, vars(cfg).get("num_attention_heads") or 1)
    if isinstance(rope, dict) and isinstance(head_dim, int):
        factor = rope.get("partial_rotary_factor", vars(cfg).get("partial_rotary_factor", 1.0)) or 1.0
        half = int(head_dim * factor) // 2
        section = rope.get("mrope_section")
        if isinstance(section, (list, tuple)) and section and sum(section) != half:
            rope["mrope_section"] = _rescale_section(section, half)


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _rescale_section(section, total: int) -> list[int]:
    """``section`` scaled to add up to ``total``, every part at least 1 (largest remainders)."""
    s = sum(section)
    raw = [v * total / s for v in section]
    out = [max(1, int(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    i = 0
    while sum(out) < total:
        out[order[i % len(order)]] += 1
        i += 1
    while sum(out) > total and max(out) > 1:
        out[out.index(max(out))] -= 1
    return out


def _fix_token_ids(cfg, remap: dict[int, int]) -> None:
    """Special token ids at or above the text-token limit move to the top of the vocabulary
    (distinct ids stay distinct, equal ids stay equal)."""

    def move(v: int) -> int:
        if v < TEXT_TOKEN_LIMIT:
            return v
        if v not in remap:
            remap[v] = VOCAB - 1 - len(remap) % (VOCAB - TEXT_TOKEN_LIMIT)
        return remap[v]

    for name, value in list(vars(cfg).items()):
        if not re.search(r"(token_id|token_index|_token_ids|_id)$", name) or name.startswith("_"):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            setattr(cfg, name, move(value))
        elif isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            setattr(cfg, name, type(value)(move(v) if v >= 0 else v for v in value))


def _fill_family_defaults(cfg) -> None:
    for key, value in FAMILY_DEFAULTS.get(getattr(cfg, "model_type", ""), {}).items():
        name, _, item = key.partition(".")
        if item:
            holder = vars(cfg).get(name)
            if isinstance(holder, dict) and item not in holder:
                holder[item] = copy.deepcopy(value)
            elif is_config(holder) and vars(holder).get(item) is None:
                setattr(holder, item, copy.deepcopy(value))  # a sub-config (e.g. dbrx's attn_config)
        elif vars(cfg).get(name) is None:
            setattr(cfg, name, copy.deepcopy(value))


def _fill_missing_layer_lists(cfg) -> None:
    """Per-layer type lists a default config leaves ``None`` (the model indexes them anyway):
    attention ``full_attention`` everywhere, MLP one dense layer then sparse ones."""
    count = _layer_count(cfg)
    if count is None:
        return
    n = count[1]
    if "layer_types" in vars(cfg) and cfg.layer_types is None:
        cfg.layer_types = ["full_attention"] * n
    if "mlp_layer_types" in vars(cfg) and cfg.mlp_layer_types is None:
        cfg.mlp_layer_types = ["dense"] * (n - 1) + ["sparse"] if n > 1 else ["sparse"]


def _fix_backbone(cfg) -> None:
    """Backbone configs name their stages after the layers: rename them, output the last one."""
    stages = vars(cfg).get("stage_names")
    count = _layer_count(cfg)
    if not isinstance(stages, list) or count is None or len(stages) == count[1] + 1:
        return
    n = count[1]
    cfg.stage_names = ["stem"] + [f"stage{i}" for i in range(1, n + 1)]
    if "_out_features" in vars(cfg):
        cfg._out_features = [cfg.stage_names[-1]]
    if "_out_indices" in vars(cfg):
        cfg._out_indices = [n]


def _shrink(cfg, remap: dict[int, int], skip: frozenset[str], depth: int = 0) -> None:
    if depth > 6:
        return
    spec = vars(cfg).get("_heterogeneity_spec")
    overrides = copy.deepcopy(spec.per_layer_overrides) if spec is not None else None
    if spec is not None:
        cfg.per_layer_config = None  # shrink the global values, then the overrides of kept layers
    _fill_family_defaults(cfg)
    before = dict(vars(cfg))
    count = _layer_count(cfg)
    old_layers = count[1] if count else None
    _apply_rules(cfg, skip)
    keep = _fix_layers(cfg, old_layers)
    _fill_missing_layer_lists(cfg)
    _ensure_attention_layer(cfg)
    _fix_backbone(cfg)
    _fix_attention(cfg, before)
    _fix_token_ids(cfg, remap)
    if overrides is not None:
        # set even when empty: some configs regenerate default overrides when none are given
        count = _layer_count(cfg)
        keep = keep if keep is not None else list(range(count[1] if count else 0))
        cfg.per_layer_config = _shrink_overrides(cfg, overrides, keep, before, skip)
    for _, sub in sub_configs(cfg):
        _shrink(sub, remap, skip, depth + 1)


# Rules dropped, in this order, when a family's config rejects the full table ("where the family
# allows"): e.g. a model that supports top-1 routing only keeps its own top-k.
_SOFT_RULES = (
    frozenset(
        {"num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k", "top_k_experts"}
    ),
)


def tiny_config(model_type_or_config):
    """A shrunk copy of a transformers config: a model type name (its default config) or a config
    object. Raises :class:`TinyError` for an unknown model type or a config that does not validate."""
    if isinstance(model_type_or_config, str):
        cfg = default_config(model_type_or_config)
    elif is_config(model_type_or_config):
        cfg = copy.deepcopy(model_type_or_config)
    else:
        raise TinyError(
            f"expected a model type name or a transformers config, got {type(model_type_or_config)}"
        )
    model_type = getattr(cfg, "model_type", "?")
    first_error: Exception | None = None
    for skip in (frozenset(), *_SOFT_RULES):
        try:
            return _shrunk_config(cfg, skip)
        except Exception as e:
            first_error = first_error or e
    raise TinyError(
        f"{model_type}: the shrunk config does not validate: {short_error(first_error)}"
    ) from first_error


def _shrunk_config(cfg, skip: frozenset[str]):
    cfg = copy.deepcopy(cfg)
    with quiet_transformers():
        _shrink(cfg, {}, skip)
        # round trip through the dict form: runs __post_init__ and validation on the new sizes
        cfg = type(cfg).from_dict(cfg.to_dict())
        if hasattr(cfg, "validate"):
            cfg.validate()
    return cfg
