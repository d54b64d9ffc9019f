"""Choose an archetype for each MoE block and confirm it by execution.

For a block the candidates are tried in order: block-level (the whole forward generated from
``archetypes/block_routed.py``), then experts-level (only the experts call, from
``archetypes/experts_routed.py``). A candidate is accepted only if, at EP=1 on a materialised copy
with random weights, the generated code reproduces the original module's output on a random probe
(fp32, relative error <= 1e-5). Otherwise the next candidate is tried, and a block no candidate
reproduces is reported unmatched with the reason.

The materialised copy has the experts' intermediate width narrowed (:func:`narrow_probe`): the check
needs the block's code paths, not its sizes, and a full-width copy of every expert of one layer can
exceed a rank's share of the model when it loads expert-parallel.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ..codegen.specialize import specialize
from ..runtime import ExpertParallelGroup, RuntimeOptions, install_expert_parallel, softmax_topk
from .structure import BlockStructure, experts_layout

PROBE_TOL = 1e-5
_RUNTIME_NAMESPACE = "hp"


@dataclass(frozen=True)
class Archetype:
    """router: softmax_topk | sigmoid_group | topk_router_module (block level) or model (experts level);
    shared: none | additive | gated | scaled (block level) or model; layout: the experts weight layout."""

    level: str
    router: str
    shared: str
    layout: str
    names: dict = field(default_factory=dict)
    constants: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"level": self.level, "router": self.router, "shared": self.shared, "layout": self.layout}


@dataclass
class MatchResult:
    structure: BlockStructure
    archetype: Archetype | None
    reason: str = ""
    tried: list[str] = field(default_factory=list)
    probe_width: int | None = None  # the experts' intermediate width in the probe; None: full width


def layout_name(experts: nn.Module) -> str:
    layout = experts_layout(experts)
    parts = [layout.kind if layout.gated else "up-only"]
    if layout.kind == "fused" and getattr(experts, "is_concatenated", True) is False:
        parts.append("interleaved")
    if layout.transposed:
        parts.append("transposed")
    if layout.up_bias or layout.down_bias:
        parts.append("bias")
    if layout.post_norm:
        parts.append("post-norm")
    return "-".join(parts)


def materialize(module: nn.Module, seed: int = 0, memo: dict | None = None) -> nn.Module:
    """A CPU fp32 copy with random weights (works for modules built on the meta device).

    ``memo`` is passed to ``copy.deepcopy``: it can map parameters to meta placeholders of other shapes.
    """
    m = copy.deepcopy(module, memo)
    if any(t.is_meta for t in list(m.parameters()) + list(m.buffers())):
        m = m.to_empty(device="cpu")
    m = m.float().eval()
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
_WIDTH_ATTRS = ("intermediate_size", "intermediate_dim", "moe_intermediate_size", "expert_dim", "ffn_dim")


def _narrow_shapes(experts: nn.Module, hidden: int) -> tuple[int, int, dict[str, tuple]] | None:
    """(full width, narrow width, narrow shape of each intermediate-sized parameter), or None."""
    layout = experts_layout(experts)
    down_in, up_out = (1, 2) if layout.transposed else (2, 1)  # down [E, H, I], up [E, I or 2I, H]
    width = getattr(experts, layout.down).shape[down_in]
    # a width equal to H (or half of it) could change the transposition read from the shapes
    narrow = next((w for w in NARROW_WIDTHS if w < width and hidden not in (w, 2 * w)), None)
    if narrow is None:
        return None
    axes = {n: up_out for n in (layout.gate, layout.up) if n}
    axes |= {n: 1 for n in (layout.gate_bias, layout.up_bias) if n}  # biases are [E, out]
    axes[layout.down] = down_in
    shapes = {}
    for name, axis in axes.items():
        shape = list(getattr(experts, name).shape)
        if shape[axis] % width:
            return None
        shape[axis] = shape[axis] // width * narrow  # keeps 2I (fused gate/up) even: 2 * narrow
        shapes[name] = tuple(shape)
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
    memo = {
        id(getattr(s.experts, name)): nn.Parameter(torch.empty(shape, device="meta"))
        for name, shape in shapes.items()
    }
    probe = materialize(s.block, seed, memo)
    experts = getattr(probe, s.experts_name)
    for attr in _WIDTH_ATTRS:
        if type(getattr(experts, attr, None)) is int and getattr(experts, attr) == width:
            setattr(experts, attr, narrow)
    if experts_layout(experts) != experts_layout(s.experts):
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


def _router_is_module_contract(router: nn.Module, hidden: torch.Tensor) -> bool:
    try:
        out = router(hidden)
    except Exception:  # noqa: BLE001 - any failure means "not this contract"
        return False
    return isinstance(out, tuple) and len(out) >= 3 and out[1].shape == out[2].shape


def _block_candidates(s: BlockStructure, probe: nn.Module, hidden: torch.Tensor, forced: dict, recorded: bool):
    """(router, shared, constants) candidates for the block-level archetype, most specific first."""
    router = getattr(probe, s.router_name)
    routers = []
    module_contract = _router_is_module_contract(router, hidden)
    top_k = getattr(router, "top_k", None) or getattr(probe, "top_k", None)
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
        routers.extend(("sigmoid_group", c) for c in _sigmoid_group_constants(router))
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


def _first_attr(module: nn.Module, names: tuple[str, ...]):
    return next((getattr(module, n) for n in names if getattr(module, n, None) is not None), None)


def _sigmoid_group_constants(router: nn.Module) -> list[dict]:
    """DeepSeek-V3 style candidates, read from the router's attributes (confirmed by execution later)."""
    bias = getattr(router, "e_score_correction_bias", None)
    top_k = _first_attr(router, ("top_k",))
    if not isinstance(bias, torch.Tensor) or not isinstance(top_k, int):
        return []
    scaling = _first_attr(router, ("routed_scaling_factor",))
    base = {
        "TOP_K": top_k,
        "NUM_GROUPS": _first_attr(router, ("n_group", "num_group")) or 1,
        "TOPK_GROUPS": _first_attr(router, ("topk_group",)) or 1,
        "RENORMALIZE": bool(_first_attr(router, ("norm_topk_prob",))),
        "SCALING": float(scaling) if scaling is not None else 1.0,
    }
    return [{**base, "MASKED_FILL": fill} for fill in (float("-inf"), 0.0)]


_DEFAULT_CONSTANTS = {"TOP_K": 1, "RENORMALIZE": False, "SCALING": None, "WEIGHTS_DTYPE": "logits",
                      "NUM_GROUPS": 1, "TOPK_GROUPS": 1, "MASKED_FILL": float("-inf"), "ROUTED_SCALE": 1.0}


def block_source(cls_name: str, arch: Archetype) -> str:
    return specialize("block_routed", "forward", f"{cls_name}_forward", arch.names, arch.constants)


def experts_source(cls_name: str) -> str:
    return specialize("experts_routed", "forward", f"{cls_name}_forward", {}, {})


def _probe_inputs(s: BlockStructure) -> torch.Tensor:
    return torch.randn(2, 5, s.hidden_size, generator=torch.Generator().manual_seed(1))


def _install_ep1(probe: nn.Module, s: BlockStructure) -> nn.Module:
    """Make the probe's experts holder expert-parallel at EP=1, in place (weights unchanged)."""
    experts = getattr(probe, s.experts_name)
    install_expert_parallel(experts, num_experts=s.num_experts, ep=ExpertParallelGroup.single(),
                            options=RuntimeOptions(), shard=False)
    return experts


def _experts_probe(s: BlockStructure):
    """Random hidden states and routing for a direct call of the experts holder."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(10, s.hidden_size, generator=g)
    r = softmax_topk(torch.randn(10, s.num_experts, generator=g), min(2, s.num_experts), renormalize=True)
    return h, r.indices, r.weights


def _original_outputs(probe: nn.Module, s: BlockStructure, x: torch.Tensor, experts_in: tuple):
    """The unmodified probe's experts output, and its block output or the exception the block raised."""
    with torch.no_grad():
        experts_ref = getattr(probe, s.experts_name)(*experts_in)
        try:
            return experts_ref, probe(x)
        except Exception as e:  # noqa: BLE001 - reported; the experts level may still fit
            return experts_ref, e


def choose_archetype(s: BlockStructure, forced: dict | None = None, recorded_router: bool = True) -> MatchResult:
    """Pick and confirm an archetype for one block. ``forced`` holds plan choices (router, shared, level)."""
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
            experts_ref, ref = _original_outputs(probe, s, x, experts_in)
        except Exception as e:  # noqa: BLE001 - the experts call failed at the narrow width
            ref = e
        if isinstance(ref, Exception):
            probe, narrow_error, result.probe_width = None, ref, None
    if probe is None:
        probe = materialize(s.block)
        experts_ref, ref = _original_outputs(probe, s, x, experts_in)
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
    returns_weights = isinstance(ref, tuple)
    level = forced.get("level", "auto")
    if level in ("auto", "block") and block_callable and s.router_name and not s.others:
        hidden = x.reshape(-1, s.hidden_size)
        for r_kind, s_mode, consts in _block_candidates(s, probe, hidden, forced, recorded_router):
            names = {"ROUTER": s.router_name, "EXPERTS": s.experts_name}
            if s.shared_name:
                names["SHARED"] = s.shared_name
            if s.shared_gate_name:
                names["SHARED_GATE"] = s.shared_gate_name
            constants = {**_DEFAULT_CONSTANTS, **consts, "ROUTER_KIND": r_kind, "SHARED_MODE": s_mode,
                         "RETURNS_ROUTER_WEIGHTS": returns_weights}
            arch = Archetype("block", r_kind, s_mode, layout, names, constants)
            try:
                fn = compile_function(block_source("probe", arch), "probe_forward")
                with torch.no_grad():
                    err = _rel(fn(probe, x), ref)
            except Exception as e:  # noqa: BLE001
                result.tried.append(f"block {r_kind}+{s_mode}: raised {type(e).__name__}: {e}")
                continue
            if err <= PROBE_TOL:
                result.archetype = arch
                return result
            result.tried.append(f"block {r_kind}+{s_mode}: output differs (rel err {err:.2e})")
    elif level in ("auto", "block"):
        why = ("no router child with weight [num_experts, hidden]" if not s.router_name
               else f"children that fit no role: {', '.join(s.others)}" if s.others else "block not callable")
        result.tried.append(f"block level: {why}")
    forced_block = [f"{k}: {forced[k]}" for k in ("router", "shared") if forced.get(k, "auto") != "auto"]
    if level == "block" or forced_block:
        # an experts-level archetype keeps the model's own router and shared code, so it cannot
        # honour a plan that asks for a given router or shared merge: report instead of ignoring it
        asked = f"the plan asks for {', '.join(forced_block)}, which only a block-level archetype honours; " if forced_block else ""
        result.reason = asked + ("; ".join(result.tried) or "no block-level archetype fits")
        return result
    holder.forward = types.MethodType(compile_function(experts_source("probe"), "probe_forward"), holder)
    with torch.no_grad():
        err = _rel(holder(*experts_in), experts_ref)
        ok, why = err <= PROBE_TOL, f"experts holder: generated forward differs from the original (rel err {err:.2e})"
        if ok and block_callable:
            err = _rel(probe(x), ref)  # the block's own forward, now calling the expert-parallel holder
            ok, why = err <= PROBE_TOL, f"block output with expert-parallel experts differs (rel err {err:.2e})"
    if ok:
        result.archetype = Archetype("experts", "model", "model", layout)
        return result
    result.tried.append(why)
    result.reason = "; ".join(result.tried)
    return result
