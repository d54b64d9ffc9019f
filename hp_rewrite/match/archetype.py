"""Choose an archetype for each MoE block and confirm it by execution.

For a block the candidates are tried in order: the archetypes the plan's ``extensions:`` registered
(:mod:`hp_rewrite.match.registry`), then the built-in block-level one (the whole forward generated
from ``archetypes/block_routed.py``), then experts-level (only the experts call, from
``archetypes/experts_routed.py``). A candidate is considered when its structural predicate holds,
with the parameters its ``derive`` function proposes, and accepted only if, at EP=1 on a materialised
copy with random weights, the generated code reproduces the original module's output on a random probe
(fp32, relative error <= 1e-5). Otherwise the next candidate is tried, and a block no candidate
reproduces is reported unmatched with the reason.

The materialised copy has the experts' intermediate width narrowed (:func:`narrow_probe`): the check
needs the block's code paths, not its sizes, and a full-width copy of every expert of one layer can
exceed a rank's share of the model when it loads expert-parallel.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..archetypes import block_routed, experts_routed, input_scaled, self_held
from ..codegen.specialize import specialize, split_params
from ..runtime import softmax_topk
from ..runtime.binding.install import install_expert_parallel
from ..runtime.group.groups import ExpertParallelGroup
from ..runtime.options import RuntimeOptions
from .registry import ArchetypeSpec, Probe, register_archetype
from .structure import BlockStructure, experts_layout

PROBE_TOL = 1e-5
_RUNTIME_NAMESPACE = "hp"


@dataclass(frozen=True)
class Archetype:
    """A confirmed archetype. router: softmax_topk | sigmoid_group | topk_router_module (block level), model
    (experts level) or extension; shared: none | additive | gated | scaled, model or extension; layout: the
    experts weight layout. ``spec`` and ``params`` generate the code (:meth:`source`)."""

    level: str
    router: str
    shared: str
    layout: str
    spec: ArchetypeSpec | None = field(default=None, compare=False, repr=False)
    params: Any = None

    def as_dict(self) -> dict:
        d = {"level": self.level, "router": self.router, "shared": self.shared, "layout": self.layout}
        if self.spec is not None and not self.spec.builtin:
            d |= {"extension": self.spec.label, "sources_sha256": self.spec.sources_sha256()}
        return d

    @property
    def names(self) -> dict[str, str]:
        """Template attribute placeholder -> the block's attribute."""
        return split_params(self.params)[0] if self.params is not None else {}

    @property
    def constants(self) -> dict[str, object]:
        return split_params(self.params)[1] if self.params is not None else {}

    def source(self, function_name: str) -> str:
        """The generated forward, named ``function_name``."""
        return specialize(self.spec.template, self.params, function_name, self.spec.function)


@dataclass
class MatchResult:
    structure: BlockStructure
    archetype: Archetype | None
    reason: str = ""
    tried: list[str] = field(default_factory=list)
    probe_width: int | None = None  # the experts' intermediate width in the probe; None: full width


def layout_name(experts: nn.Module) -> str:
    layout = experts_layout(experts)
    parts = ["modules"] if layout.modules else []
    parts.append(("gated" if layout.modules else layout.kind) if layout.gated else "up-only")
    if layout.kind == "fused" and getattr(experts, "is_concatenated", True) is False:
        parts.append("interleaved")
    if layout.flat:
        parts.append("flat")
    if layout.split:
        parts.append("split")
    if layout.transposed:
        parts.append("transposed")
    if layout.up_bias or layout.down_bias:
        parts.append("bias")
    if layout.post_norm:
        parts.append("post-norm")
    if layout.zero_experts:
        parts.append("zero-experts")
    return "-".join(parts)


def materialize(module: nn.Module, seed: int = 0, memo: dict | None = None) -> nn.Module:
    """A CPU fp32 copy with random weights (works for modules built on the meta device), whose experts
    run their own forward (``experts_implementation`` eager: a transformers kernel the user chose,
    e.g. a GPU-only one, is not what the probe checks the rewrite against).

    ``memo`` is passed to ``copy.deepcopy``: it can map parameters to meta placeholders of other shapes.
    """
    m = copy.deepcopy(module, memo)
    if any(t.is_meta for t in list(m.parameters()) + list(m.buffers())):
        m = m.to_empty(device="cpu")
    m = m.float().eval()
    for sub in m.modules():  # the copy's own config: the module's own forward, whatever the user set
        config = getattr(sub, "config", None)
        if isinstance(getattr(config, "_experts_implementation", None), str):
            config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():  # in place: a probe of a DeepSeek-V3 block is ~10^8 values
            p.normal_(0.0, 0.02 if name.endswith("bias") else 0.2, generator=g)
        for name, b in m.named_buffers():
            if b.is_floating_point():
                b.normal_(0.0, 0.05 if "bias" in name else 1.0, generator=g)
    return m


#: Expert intermediate widths tried for the probe, in order (see :func:`narrow_probe`).
NARROW_WIDTHS = (16, 24, 12)
_WIDTH_ATTRS = ("intermediate_size", "intermediate_dim", "moe_intermediate_size", "expert_dim", "ffn_dim",
                "ffn_hidden_size")


def _narrow_shapes(experts: nn.Module, hidden: int) -> tuple[int, int, dict[str, tuple]] | None:
    """(full width, narrow width, narrow shape of each intermediate-sized parameter), or None. Experts
    held as modules: the shapes of one expert's parameters (named by their role)."""
    layout = experts_layout(experts)
    lead = 0 if layout.modules else 1  # one expert's [out, in], or [E, out, in]
    down_in = 1 if layout.transposed_of(layout.down) else 2  # down [E, H, I]
    up_out = 2 if layout.transposed else 1  # up [E, I or 2I, H]
    down_in, up_out = down_in - 1 + lead, up_out - 1 + lead

    def shape_of(name: str) -> list[int]:
        if layout.modules:
            return list(layout.param(experts, f"{layout.held[0]}.{name}").shape)
        return list(layout.weight(experts, name).shape)

    width = shape_of(layout.down)[down_in]
    # a width equal to H (or half of it) could change the transposition read from the shapes
    narrow = next((w for w in NARROW_WIDTHS if w < width and hidden not in (w, 2 * w)), None)
    if narrow is None:
        return None
    axes = {n: up_out for n in (layout.gate, layout.up) if n}
    axes |= {n: lead for n in (layout.gate_bias, layout.up_bias) if n}  # biases are [E, out]
    axes[layout.down] = down_in
    shapes = {}
    for name, axis in axes.items():
        shape = shape_of(name)
        if shape[axis] % width:
            return None
        shape[axis] = shape[axis] // width * narrow  # keeps 2I (fused gate/up) even: 2 * narrow
        shapes[name] = tuple(shape) if not layout.flat else (shape[0] * shape[1], *shape[2:])  # as stored
    return width, narrow, shapes


def narrow_probe(s: BlockStructure, seed: int = 0) -> tuple[nn.Module, int] | None:
    """:func:`materialize` of the block with the experts' intermediate width narrowed, and that width.

    The full-width copy holds every expert of one layer in fp32, more than a rank's share of the
    model when it loads expert-parallel; the check needs the code paths, not the sizes. Only the
    experts' intermediate-sized parameters (and int attributes naming that width) change: they are
    swapped for meta placeholders before the copy is allocated, so the full width is never allocated.
    Router, shared experts and hidden size keep their sizes. None when the width is already small or
    the narrowed copy would read as another layout.
    """
    found = _narrow_shapes(s.experts, s.hidden_size)
    if found is None:
        return None
    width, narrow, shapes = found
    layout = experts_layout(s.experts)
    held = [f"{k}." for k in layout.held] if layout.modules else [""]
    memo = {
        id(layout.param(s.experts, key + name)): nn.Parameter(torch.empty(shape, device="meta"))
        for name, shape in shapes.items() for key in held
    }
    probe = materialize(s.block, seed, memo)
    experts = _experts_of(probe, s)
    for m in experts.modules() if layout.flat or layout.modules or layout.split else [experts]:  # children too
        for attr in _WIDTH_ATTRS:
            if type(getattr(m, attr, None)) is int and getattr(m, attr) == width:
                setattr(m, attr, narrow)
        if isinstance(m, nn.Linear):
            m.out_features, m.in_features = m.weight.shape
    narrowed = experts_layout(experts)
    if narrowed is None or replace(narrowed, flat=0) != replace(layout, flat=0):
        return None
    return probe, narrow


def compile_function(source: str, name: str):
    """Turn generated source into a function (probe use; artifacts are imported from their file)."""
    from .. import runtime as hp

    namespace = {"torch": torch, _RUNTIME_NAMESPACE: hp}
    exec(compile(source, f"<hp-rewrite probe {name}>", "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace[name]


def _rel(a, b) -> float:
    if isinstance(b, tuple) != isinstance(a, tuple):
        return float("inf")
    if isinstance(b, tuple):
        if len(a) != len(b):
            return float("inf")
        return max(_rel(x, y) for x, y in zip(a, b, strict=True))
    if not isinstance(b, torch.Tensor):
        return 0.0 if a == b else float("inf")
    if a.shape != b.shape:
        return float("inf")
    scale = b.float().abs().max().clamp_min(1e-12)
    return ((a.float() - b.float()).abs().max() / scale).item()


def _experts_of(block: nn.Module, s: BlockStructure) -> nn.Module:
    """The experts holder of (a copy of) ``s``'s block: the block itself when it holds its experts."""
    return block if s.self_held else getattr(block, s.experts_name)


def _router_is_module_contract(router: nn.Module, hidden: torch.Tensor) -> bool:
    try:
        out = router(hidden)
    except Exception:  # noqa: BLE001 - any failure means "not this contract"
        return False
    return isinstance(out, tuple) and len(out) >= 3 and out[1].shape == out[2].shape


def _block_candidates(s: BlockStructure, probe: nn.Module, hidden: torch.Tensor, forced: dict, recorded: bool):
    """(router, shared, constants) candidates for the block-level archetype, most specific first."""
    router = probe.get_submodule(s.router_name)
    routers = []
    module_contract = _router_is_module_contract(router, hidden)
    top_k = _lookup(("top_k", "num_experts_per_tok"), router, probe)
    if forced.get("router", "auto") in ("auto", "topk_router_module") and module_contract:
        routers.append(("topk_router_module", {}))
    if not recorded or forced.get("router") in ("softmax_topk", "sigmoid_group"):
        if isinstance(top_k, int) and forced.get("router", "auto") in ("auto", "softmax_topk"):
            dtypes = ("logits", "fp32") if forced.get("router_dtype", "auto") == "auto" else (forced["router_dtype"],)
            for renorm in (True, False):
                for dtype in dtypes:
                    routers.append(("softmax_topk", {"TOP_K": top_k, "RENORMALIZE": renorm, "WEIGHTS_DTYPE": dtype}))
    if (not recorded or forced.get("router") == "sigmoid_group") and forced.get("router", "auto") in (
        "auto", "sigmoid_group"
    ):
        routers.extend(("sigmoid_group", c) for c in _sigmoid_group_constants(router, probe))
    if forced.get("router", "auto") != "auto":
        routers = [r for r in routers if r[0] == forced["router"]]
    shared_modes = []
    if s.shared_name is None:
        shared_modes.append(("none", {}))
    elif s.shared_gate_name is not None:
        shared_modes.append(("gated", {}))
    else:
        shared_modes.append(("additive", {}))
        for attr, value in sorted(vars(probe).items()):
            if isinstance(value, float) and not attr.startswith("_"):
                shared_modes.append(("scaled", {"ROUTED_SCALE": value}))
    if forced.get("shared", "auto") != "auto":
        shared_modes = [m for m in shared_modes if m[0] == forced["shared"]]
    for r_kind, r_consts in routers:
        for s_mode, s_consts in shared_modes:
            yield r_kind, s_mode, {**r_consts, **s_consts}


def _lookup(names: tuple[str, ...], router: nn.Module, block: nn.Module):
    """The first of the attributes ``names`` set on the router, else on the block, else on the block's
    config (routing written inline in the block reads its settings from there, as remote code does)."""
    for owner in (router, block, getattr(block, "config", None)):
        value = next((getattr(owner, n) for n in names if getattr(owner, n, None) is not None), None)
        if value is not None and not isinstance(value, nn.Module):
            return value
    return None


def _sigmoid_group_constants(router: nn.Module, block: nn.Module) -> list[dict]:
    """DeepSeek-V3 style candidates, read from the router's attributes, else the block's or its config's
    (confirmed by execution later). The correction bias lives on the router or on the block."""
    on_router = isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor)
    on_block = not on_router and isinstance(getattr(block, "e_score_correction_bias", None), torch.Tensor)
    top_k = _lookup(("top_k", "num_experts_per_tok"), router, block)
    if not (on_router or on_block) or not isinstance(top_k, int):
        return []
    scaling = _lookup(("routed_scaling_factor",), router, block)
    norm = _lookup(("norm_topk_prob",), router, block)
    base = {
        "TOP_K": top_k,
        "NUM_GROUPS": _lookup(("n_group", "num_group"), router, block) or 1,
        "TOPK_GROUPS": _lookup(("topk_group",), router, block) or 1,
        "SCALING": float(scaling) if scaling is not None else 1.0,
        "BIAS_ON_BLOCK": on_block,
    }
    renorms = (bool(norm),) if norm is not None else (True, False)
    return [{**base, "RENORMALIZE": r, "MASKED_FILL": fill} for r in renorms for fill in (float("-inf"), 0.0)]


def _block_routed_params(s: BlockStructure, probe: Probe):
    """The built-in block-level archetype's candidates, most specific first."""
    names = {"ROUTER": s.router_name, "EXPERTS": s.experts_name, "SHARED": s.shared_name,
             "SHARED_GATE": s.shared_gate_name}
    for r_kind, s_mode, consts in _block_candidates(s, probe.block, probe.hidden, probe.forced, probe.recorded_router):
        yield block_routed.Params(**names, **consts, ROUTER_KIND=r_kind, SHARED_MODE=s_mode,
                                  RETURNS_ROUTER_WEIGHTS=probe.returns_router_weights)


BLOCK_ROUTED = register_archetype(
    "block_routed", template=block_routed, params=block_routed.Params, origin="hp_rewrite",
    predicate=lambda s: s.router_name is not None and not s.others, derive=_block_routed_params,
    describe=lambda p: (p.ROUTER_KIND, p.SHARED_MODE),
)
def _input_scaled_params(s: BlockStructure, probe: Probe):
    """Candidates for a routing-free holder: the router module returns (scores, logits) and the block
    scales the experts' input by the scores (Llama 4)."""
    if probe.forced.get("router", "auto") != "auto":
        return None  # a plan that names a router kind asks for output-side routing weights: not this archetype
    router = probe.block.get_submodule(s.router_name)
    top_k = getattr(router, "top_k", None) or getattr(probe.block, "top_k", None)
    if not isinstance(top_k, int):
        return None
    modes = [m for m in (["none"] if s.shared_name is None else ["additive"])
             if probe.forced.get("shared", "auto") in ("auto", m)]
    return [input_scaled.Params(ROUTER=s.router_name, EXPERTS=s.experts_name, SHARED=s.shared_name, TOP_K=top_k,
                                SHARED_MODE=mode, RETURNS_ROUTER_LOGITS=probe.returns_router_weights, FLAT_OUTPUT=flat)
            for mode in modes for flat in (False, True)]


def _self_held_params(s: BlockStructure, probe: Probe):
    """Candidates for a block holding its experts (JetMoE): softmax top-k of the router Linear (top-k over
    the logits then softmax is the same), with the block's ``[hidden]`` parameter as output bias."""
    if probe.forced.get("router", "auto") not in ("auto", "softmax_topk") or \
            probe.forced.get("shared", "auto") not in ("auto", "none"):
        return None
    path = s.router_name.split(".")
    owners = [probe.block.get_submodule(".".join(path[:i])) for i in range(len(path), 0, -1)]
    top_k = next((k for o in owners if isinstance(k := getattr(o, "top_k", None), int)), None)
    if top_k is None:
        return None
    biases = [n for n, p in probe.block.named_parameters(recurse=False) if tuple(p.shape) == (s.hidden_size,)]
    bias = {"OUTPUT_BIAS": biases[0], "HAS_OUTPUT_BIAS": True} if len(biases) == 1 else {}
    return [self_held.Params(ROUTER=s.router_name, TOP_K=top_k, RENORMALIZE=renorm, WEIGHTS_DTYPE=dtype, **bias)
            for renorm in (True, False) for dtype in ("logits", "fp32")]


SELF_HELD = register_archetype(
    "self_held", template=self_held, params=self_held.Params, origin="hp_rewrite",
    predicate=lambda s: s.self_held and s.router_name is not None and s.shared_name is None and not s.others,
    derive=_self_held_params, describe=lambda p: ("softmax_topk", "none"),
)
INPUT_SCALED = register_archetype(
    "input_scaled", template=input_scaled, params=input_scaled.Params, origin="hp_rewrite",
    predicate=lambda s: s.routing_free and s.router_name is not None and s.shared_gate_name is None and not s.others,
    derive=_input_scaled_params, describe=lambda p: ("input_scaled", p.SHARED_MODE),
)
EXPERTS_ROUTED = register_archetype(
    "experts_routed", template=experts_routed, params=experts_routed.Params, origin="hp_rewrite", level="experts",
    predicate=lambda s: True, derive=lambda s, probe: experts_routed.Params(), describe=lambda p: ("model", "model"),
)


def block_source(cls_name: str, arch: Archetype) -> str:
    return arch.source(f"{cls_name}_forward")


def experts_source(cls_name: str, params: experts_routed.Params | None = None) -> str:
    return specialize(experts_routed, params or experts_routed.Params(), f"{cls_name}_forward")


def _probe_inputs(s: BlockStructure) -> torch.Tensor:
    return torch.randn(2, 5, s.hidden_size, generator=torch.Generator().manual_seed(1))


def _install_ep1(probe: nn.Module, s: BlockStructure) -> nn.Module:
    """Make the probe's experts holder expert-parallel at EP=1, in place (weights unchanged)."""
    experts = _experts_of(probe, s)
    install_expert_parallel(experts, num_experts=s.num_experts, ep=ExpertParallelGroup.single(),
                            options=RuntimeOptions(), shard=False)
    return experts


def _experts_probe(s: BlockStructure):
    """Random hidden states and routing for a direct call of the experts holder."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(10, s.hidden_size, generator=g)
    total = s.num_experts + s.zero_experts  # zero experts' ids too: the probe confirms they are identity
    r = softmax_topk(torch.randn(10, total, generator=g), min(2, total), renormalize=True)
    return h, r.indices, r.weights


def _experts_reference(probe: nn.Module, s: BlockStructure, experts_in: tuple) -> tuple[tuple, torch.Tensor | None]:
    """The routing the holder takes and its unmodified output (None for a holder the block drives
    itself): ``(hidden, top_k_index, top_k_weights)``, else for experts held as modules the same as
    one-hot dispatch masks ``[T, K, E]`` (Switch Transformers')."""
    if s.routing_free or s.calls_each_expert or s.self_held:
        return experts_in, None
    experts = _experts_of(probe, s)
    try:
        return experts_in, experts(*experts_in)
    except Exception:
        if not s.expert_modules:
            raise
        h, indices, weights = experts_in
        masks = (h, torch.nn.functional.one_hot(indices, s.num_experts), weights)
        return masks, experts(*masks)


def _original_outputs(probe: nn.Module, s: BlockStructure, x: torch.Tensor, experts_in: tuple):
    """The holder's routing inputs and unmodified output (:func:`_experts_reference`), and the block's
    output or the exception the block raised."""
    with torch.no_grad():
        experts_in, experts_ref = _experts_reference(probe, s, experts_in)
        try:
            return experts_in, experts_ref, probe(x)
        except Exception as e:  # noqa: BLE001 - reported; the experts level may still fit
            return experts_in, experts_ref, e


def choose_archetype(s: BlockStructure, forced: dict | None = None, recorded_router: bool = True,
                     extensions: Sequence[ArchetypeSpec] = ()) -> MatchResult:
    """Pick and confirm an archetype for one block. ``forced`` holds plan choices (router, shared, level);
    ``extensions`` the archetypes the plan's ``extensions:`` registered, tried before the built-in ones."""
    forced = forced or {}
    result = MatchResult(s, None)
    layout = layout_name(s.experts)
    # One materialised copy of the block (random weights, narrow experts) serves every candidate: the
    # original outputs are taken first, then its experts holder is made expert-parallel (EP=1) in place.
    # If the narrow copy's own forward fails, the full-width copy is used instead.
    x = _probe_inputs(s)
    experts_in = _experts_probe(s)
    probe, narrow_error = None, None
    narrow = narrow_probe(s)
    if narrow is not None:
        probe, result.probe_width = narrow
        try:
            experts_in, experts_ref, ref = _original_outputs(probe, s, x, experts_in)
        except Exception as e:  # noqa: BLE001 - the experts call failed at the narrow width
            ref = e
        if isinstance(ref, Exception):
            probe, narrow_error, result.probe_width = None, ref, None
    if probe is None:
        probe = materialize(s.block)
        experts_in, experts_ref, ref = _original_outputs(probe, s, x, _experts_probe(s))
        if narrow_error is not None and not (isinstance(ref, Exception) and repr(ref) == repr(narrow_error)):
            result.tried.append(
                f"probe at expert width {narrow[1]} raised {type(narrow_error).__name__}: "
                f"{narrow_error}; probed at full width"
            )
    block_callable = not isinstance(ref, Exception)
    if not block_callable:
        result.tried.append(f"block forward(hidden) raised {type(ref).__name__}: {ref}")
        ref = None
    holder = _install_ep1(probe, s)
    level = forced.get("level", "auto")
    forced_block = [f"{k}: {forced[k]}" for k in ("router", "shared") if forced.get(k, "auto") != "auto"]
    if level in ("auto", "block"):
        ctx = Probe(probe, x.reshape(-1, s.hidden_size), forced, recorded_router, isinstance(ref, tuple))
        builtin = SELF_HELD if s.self_held else INPUT_SCALED if s.routing_free else BLOCK_ROUTED
        specs = [e for e in extensions if e.level == "block"] + [builtin]
        for spec in specs:
            arch = _confirm_block(spec, s, ctx, x, ref, block_callable, layout, forced_block, result.tried)
            if arch is not None:
                result.archetype = arch
                return result
    if level == "block" or forced_block:
        # an experts-level archetype keeps the model's own router and shared code, so it cannot
        # honour a plan that asks for a given router or shared merge: report instead of ignoring it
        asked = f"the plan asks for {', '.join(forced_block)}, which only a block-level archetype honours; " if forced_block else ""
        result.reason = asked + ("; ".join(result.tried) or "no block-level archetype fits")
        return result
    no_experts_level = _no_experts_level(s)
    if no_experts_level:
        result.tried.append(f"experts level: {no_experts_level}, so only a block-level archetype can drive it")
        result.reason = "; ".join(result.tried)
        return result
    whys = []
    for params in _experts_candidates(s):
        ok, why = _confirm_experts(holder, params, probe, x, ref, experts_in, experts_ref, block_callable)
        if ok:
            result.archetype = Archetype("experts", "model", "model", layout, EXPERTS_ROUTED, params)
            return result
        whys.append(why)
    why = whys[0]
    if s.zero_experts:  # say what was assumed of the extra rows
        why += (f" (ids {s.num_experts}..{s.num_experts + s.zero_experts - 1} taken as zero (identity) experts, "
                f"w * x: {type(s.experts).__name__}'s {experts_layout(s.experts).up} holds {s.zero_experts} "
                "experts more than its down projection)")
    result.tried.append(why)
    result.reason = "; ".join(result.tried)
    return result


def _no_experts_level(s: BlockStructure) -> str | None:
    """Why the experts holder cannot be driven on its own (the block routes and calls it its own way)."""
    if s.self_held:
        return f"{type(s.block).__name__} holds its experts' weights in its own children and routes inside its forward"
    if s.calls_each_expert:
        return f"the block calls each of its {type(s.experts).__name__}'s expert modules itself"
    if s.routing_free:
        return (f"{type(s.experts).__name__}.forward takes the hidden rows only (no top_k_index, top_k_weights): "
                "the block applies the routing itself")
    return None


def _experts_candidates(s: BlockStructure) -> list[experts_routed.Params]:
    """The experts-level forward as is, then (experts held as modules) with the eval-mode scale ``1 - p``
    of each dropout the container applies to the expert outputs itself (NLLB-MoE's token dropout)."""
    own = [m for name, m in s.experts.named_children() if not any(True for _ in m.parameters())]
    scales = [1 - m.p for m in own if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    return [experts_routed.Params()] + [experts_routed.Params(EVAL_SCALE=float(p)) for p in scales]


def _confirm_experts(holder: nn.Module, params, probe: nn.Module, x: torch.Tensor, ref, experts_in: tuple,
                     experts_ref, block_callable: bool) -> tuple[bool, str]:
    """Whether the experts-level forward with ``params`` reproduces the holder's and the block's outputs."""
    holder.forward = types.MethodType(compile_function(experts_source("probe", params), "probe_forward"), holder)
    try:
        with torch.no_grad():
            out = holder(*experts_in)
            if isinstance(out, torch.Tensor) and isinstance(experts_ref, torch.Tensor) and \
                    out.numel() == experts_ref.numel() and out.shape[-1] == experts_ref.shape[-1]:
                out = out.reshape(experts_ref.shape)  # the same rows; DBRX's holder returns [T, 1, H] for [T, H]
            err = _rel(out, experts_ref)
            ok, why = err <= PROBE_TOL, f"experts holder: generated forward differs from the original (rel err {err:.2e})"
            if ok and block_callable:
                err = _rel(probe(x), ref)  # the block's own forward, now calling the expert-parallel holder
                ok, why = err <= PROBE_TOL, f"block output with expert-parallel experts differs (rel err {err:.2e})"
    except Exception as e:  # noqa: BLE001 - e.g. the block calls its experts under another contract
        ok, why = False, f"experts level: raised {type(e).__name__}: {e}"
    return ok, why


def _confirm_block(spec: ArchetypeSpec, s: BlockStructure, ctx: Probe, x: torch.Tensor, ref, block_callable: bool,
                   layout: str, forced_block: list[str], tried: list[str]) -> Archetype | None:
    """The first of ``spec``'s candidates whose generated forward reproduces ``ref``, else None (``tried``
    says why)."""
    if not spec.builtin:
        if forced_block:
            tried.append(f"extension {spec.label}: not tried, the plan forces {', '.join(forced_block)}")
            return None
        try:
            fits = bool(spec.predicate(s))
        except Exception as e:  # noqa: BLE001
            tried.append(f"extension {spec.label}: predicate raised {type(e).__name__}: {e}")
            return None
        if not fits or not block_callable:
            tried.append(f"extension {spec.label}: {'block not callable' if fits else 'predicate false'}")
            return None
    elif not (block_callable and spec.predicate(s)):
        why = ("no router child with weight [num_experts, hidden]" if not s.router_name
               else "a shared-expert gate, which input-scaled routing does not merge" if s.shared_gate_name and s.routing_free
               else f"children that fit no role: {', '.join(s.others)}" if s.others else "block not callable")
        tried.append(f"block level: {why}")
        return None
    try:
        candidates = spec.candidates(s, ctx)
    except Exception as e:  # noqa: BLE001
        tried.append(f"extension {spec.label}: derive raised {type(e).__name__}: {e}")
        return None
    for params in candidates:
        router, shared = spec.labels(params)
        arch = Archetype("block", router, shared, layout, spec, params)
        what = f"block {router}+{shared}" if spec.builtin else f"extension {spec.label}"
        try:
            fn = compile_function(arch.source("probe_forward"), "probe_forward")
            with torch.no_grad():
                err = _rel(fn(ctx.block, x), ref)
        except Exception as e:  # noqa: BLE001
            tried.append(f"{what}: raised {type(e).__name__}: {e}")
            continue
        if err <= PROBE_TOL:
            return arch
        tried.append(f"{what}: output differs (rel err {err:.2e})")
    return None
