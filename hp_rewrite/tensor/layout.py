"""Which dense module of a rewritten model is split how over the TP group: its :class:`TensorLayout`.

The layout comes from transformers' own ``base_model_tp_plan`` where the family has one (minus its
expert entries: experts are never TP-split, they are expert-parallel over the extended EP group),
and from the matched structure where it does not cover a module (DeepSeek's MLA attention, Qwen2-MoE's
shared expert). Every direct child of a decoder layer must be understood: an attention (``q/k/v/o``
or MLA), a gated MLP, the MoE block, a norm, or a module without parameters. Anything else, and any
size the TP group does not divide, is refused with the reason, before a weight is touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from .errors import TensorParallelError

COLWISE, ROWWISE, HEAD_NORM, MLA_ROPE = "colwise", "rowwise", "head_norm", "mla_rope"
# transformers' styles hp-rewrite applies, by their names in base_model_tp_plan
_HF_STYLES = {"colwise": COLWISE, "rowwise": ROWWISE, "replicated_with_grad_allreduce": HEAD_NORM,
              "mla_kv_a_proj": MLA_ROPE}
# styles whose module is kept whole: still exact (its input and output are replicated), only not split
_HF_KEPT_WHOLE = {"embedding_rowwise", "embedding_colwise", "colwise_gather_output", "replicate"}
_MLA_WHOLE = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm")


@dataclass(frozen=True)
class MoeBlockSpec:
    """What the TP layer needs to know of one MoE block (from the structure matcher)."""

    path: str
    experts: str  # child name of the experts holder
    shared: str | None = None  # child name of the shared expert (a gated MLP, split like one)


@dataclass
class TensorLayout:
    """The TP layout of one model: module path -> style, and the SP boundaries.

    styles: ``colwise`` / ``rowwise`` (Linear), ``head_norm`` (a norm over one head's features, fed this
        rank's heads: replicated weights whose gradients are summed over the group), ``mla_rope``
        (MLA's ``kv_a_proj_with_mqa``: its rotary columns feed every local head).
    layers: the decoder layers, in order (sequence parallelism enters at the first, leaves at the last).
    mixers: per decoder layer, its attention and MLP paths (their input is gathered under SP; their
        ``rowwise`` output is reduce-scattered onto the sequence).
    moe: the MoE block paths (gathered in and shared out under SP; routed tokens shared in dispatch).
    norms: the decoder layers' norms (sequence-sharded under SP).
    rope_width: per ``mla_rope`` module, how many trailing output columns are the rotary part.
    """

    styles: dict[str, str] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)
    mixers: list[str] = field(default_factory=list)
    moe: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    rope_width: dict[str, int] = field(default_factory=dict)


def _linear(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Linear)


def _is_norm(module: nn.Module) -> bool:
    params = list(module.parameters(recurse=False))
    return not list(module.children()) and bool(params) and all(p.dim() == 1 for p in params)


def _is_attention(module: nn.Module) -> bool:
    return _linear(getattr(module, "o_proj", None)) and (
        _linear(getattr(module, "q_proj", None)) or _linear(getattr(module, "q_b_proj", None)))


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(_linear(getattr(module, n, None)) for n in ("gate_proj", "up_proj", "down_proj"))


def _pattern(path: str) -> str:
    """transformers' tp-plan key of a module path: layer numbers become ``*``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)


def _decoder_layers(model: nn.Module, blocks: list[MoeBlockSpec]) -> list[str]:
    """The decoder layers: the children of the list holding the MoE blocks' parents."""
    parents = {b.path.rpartition(".")[0] for b in blocks}
    lists = {p.rpartition(".")[0] for p in parents}
    if len(lists) != 1 or not isinstance(model.get_submodule(next(iter(lists))), nn.ModuleList):
        raise TensorParallelError(
            f"tp_size > 1: the MoE blocks {sorted(b.path for b in blocks)} are not the layers of one decoder "
            "layer list; hp-rewrite splits only decoder stacks (one nn.ModuleList of layers)"
        )
    stack = next(iter(lists))
    return [f"{stack}.{name}" for name, _ in model.get_submodule(stack).named_children()]


def _hf_styles(model: nn.Module) -> tuple[dict[str, str], str]:
    """transformers' plan keys (relative to the base model) and the base model's path prefix."""
    base = getattr(model, "base_model", model)
    prefix = next((name for name, m in model.named_modules() if m is base), "")
    config = getattr(base, "config", None)
    plan = dict(getattr(base, "_tp_plan", None) or getattr(config, "base_model_tp_plan", None) or {})
    return plan, prefix


def plan_layout(model: nn.Module, blocks: list[MoeBlockSpec], tp_size: int) -> TensorLayout:
    """The :class:`TensorLayout` of ``model`` over ``tp_size`` ranks, or a :class:`TensorParallelError`."""
    layout = TensorLayout(moe=[b.path for b in blocks])
    moe = {b.path: b for b in blocks}
    hf_plan, prefix = _hf_styles(model)
    layout.layers = _decoder_layers(model, blocks)
    for layer_path in layout.layers:
        for name, child in model.get_submodule(layer_path).named_children():
            path = f"{layer_path}.{name}"
            if path in moe:
                if moe[path].shared is not None:
                    _mlp_styles(model, f"{path}.{moe[path].shared}", hf_plan, prefix, layout, tp_size)
            elif _is_attention(child):
                _attention_styles(model, path, hf_plan, prefix, layout, tp_size)
                layout.mixers.append(path)
            elif _is_gated_mlp(child):
                _mlp_styles(model, path, hf_plan, prefix, layout, tp_size)
                layout.mixers.append(path)
            elif _is_norm(child):
                layout.norms.append(path)
            elif any(True for _ in child.parameters()):
                raise TensorParallelError(
                    f"tp_size > 1: {path} ({type(child).__name__}) is neither an attention (q/k/v/o or MLA "
                    "projections), a gated MLP, a norm nor the MoE block, so hp-rewrite cannot split it over the "
                    "TP group; use tp_size: 1 for this model"
                )
    return layout


def _planned(path: str, hf_plan: dict[str, str], prefix: str) -> str | None:
    """The hp-rewrite style transformers' plan gives the module at ``path`` (None: not in the plan)."""
    relative = path[len(prefix) + 1:] if prefix and path.startswith(prefix + ".") else path
    style = hf_plan.get(_pattern(relative))
    if style is None or style in _HF_KEPT_WHOLE:
        return None
    if style not in _HF_STYLES:
        raise TensorParallelError(
            f"tp_size > 1: transformers' tensor-parallel plan gives {path} the style {style!r}, which hp-rewrite "
            f"does not implement (it applies {sorted(_HF_STYLES)}); use tp_size: 1 for this model"
        )
    return _HF_STYLES[style]


def _set(layout: TensorLayout, model: nn.Module, path: str, style: str, tp_size: int) -> None:
    module = model.get_submodule(path)
    if style in (COLWISE, ROWWISE):
        if not _linear(module):
            raise TensorParallelError(f"tp_size > 1: {path} ({type(module).__name__}) is not a Linear; "
                                      f"it cannot be split {style}")
        size = module.out_features if style == COLWISE else module.in_features
        if size % tp_size:
            raise TensorParallelError(
                f"tp_size {tp_size} does not divide {path}'s {'output' if style == COLWISE else 'input'} "
                f"features ({size}): choose a tp_size that divides it"
            )
    layout.styles[path] = style


def _heads(model: nn.Module, path: str, tp_size: int) -> None:
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp_size:
            raise TensorParallelError(
                f"tp_size {tp_size} does not divide {key}={heads} ({path} splits whole heads over the TP group): "
                "choose a tp_size that divides it"
            )


def _attention_styles(model, path: str, hf_plan, prefix, layout: TensorLayout, tp_size: int) -> None:
    attn = model.get_submodule(path)
    _heads(model, path, tp_size)
    own = [n for n, _ in attn.named_parameters(recurse=False)]
    if own:
        raise TensorParallelError(
            f"tp_size > 1: {path} ({type(attn).__name__}) holds parameters of its own ({', '.join(own)}), one per "
            "head perhaps; hp-rewrite cannot split them over the TP group; use tp_size: 1 for this model"
        )
    mla = _linear(getattr(attn, "kv_b_proj", None))
    head_dim = getattr(attn, "head_dim", None)
    for n, child in attn.named_children():
        style = _planned(f"{path}.{n}", hf_plan, prefix) or _structural(n, child, mla, head_dim)
        if style is None and any(True for _ in child.parameters()) and n not in _MLA_WHOLE:
            raise TensorParallelError(
                f"tp_size > 1: {path}.{n} ({type(child).__name__}) is neither split nor known to be safe to keep "
                "whole in hp-rewrite's tensor-parallel attention; use tp_size: 1 for this model"
            )
        if style is not None:
            _set(layout, model, f"{path}.{n}", style, tp_size)
        if style == MLA_ROPE:
            width = getattr(attn, "qk_rope_head_dim", None)
            if not isinstance(width, int):
                raise TensorParallelError(f"tp_size > 1: {path} has kv_a_proj_with_mqa but no qk_rope_head_dim")
            layout.rope_width[f"{path}.{n}"] = width


def _structural(name: str, child: nn.Module, mla: bool, head_dim: int | None) -> str | None:
    """The style of an attention child by its role (where transformers' plan does not name it)."""
    if name in ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj"):
        return COLWISE
    if name == "o_proj":
        return ROWWISE
    if name == "kv_a_proj_with_mqa" and mla:
        return MLA_ROPE
    if name in _MLA_WHOLE:
        return None
    if _is_norm(child) and all(p.numel() == head_dim for p in child.parameters()):
        return HEAD_NORM  # q_norm / k_norm, query_layernorm / key_layernorm: one head's features
    return None


def _mlp_styles(model, path: str, hf_plan, prefix, layout: TensorLayout, tp_size: int) -> None:
    mlp = model.get_submodule(path)
    if not _is_gated_mlp(mlp):
        raise TensorParallelError(
            f"tp_size > 1: {path} ({type(mlp).__name__}) is not a gated MLP (gate_proj, up_proj, down_proj), so "
            "hp-rewrite cannot split it over the TP group; use tp_size: 1 for this model"
        )
    for n, default in (("gate_proj", COLWISE), ("up_proj", COLWISE), ("down_proj", ROWWISE)):
        _set(layout, model, f"{path}.{n}", _planned(f"{path}.{n}", hf_plan, prefix) or default, tp_size)
    extra = [n for n, c in mlp.named_children() if n not in ("gate_proj", "up_proj", "down_proj")
             and any(True for _ in c.parameters())]
    if extra or list(mlp.parameters(recurse=False)):
        raise TensorParallelError(f"tp_size > 1: {path} holds parameters beyond gate/up/down_proj "
                                  f"({extra}); hp-rewrite cannot split it; use tp_size: 1 for this model")
