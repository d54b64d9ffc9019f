"""Find MoE blocks by structure: experts holders, their routers, shared experts and shared gates.

Nothing here looks at model names or reads transformers source text. An *experts holder* is a module
with an integer ``num_experts`` (or zero experts: :func:`routed_experts`) and per-expert weights
(dim 0 = experts) in a layout the runtime knows, whose forward takes ``(hidden, top_k_index, top_k_weights)``, or only ``hidden`` (a
routing-free holder: the block applies the routing, so only a block-level archetype can drive it). Its parent is the candidate
*block*; the block's other children are classified by their parameter shapes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

from ..runtime.compute import expert_modules
from ..runtime.compute.experts import ExpertsLayout
from ..runtime.errors import ExpertParallelError


@dataclass
class BlockStructure:
    """What a block is made of (attribute names on the block), before any execution check."""

    path: str
    block: nn.Module
    experts_name: str
    experts: nn.Module
    num_experts: int
    hidden_size: int
    router_name: str | None = None
    shared_name: str | None = None
    shared_gate_name: str | None = None
    others: list[str] = field(default_factory=list)  # children that fit no role (norms, projections...)
    routing_free: bool = False  # the holder's forward takes no routing (see routing_free())
    zero_experts: int = 0  # identity experts after the routed ones (ids num_experts..), see routed_experts()
    expert_modules: bool = False  # a ModuleList / ModuleDict of expert modules (runtime.expert_modules)
    calls_each_expert: bool = False  # ... without a forward of its own: the block calls each expert itself
    self_held: bool = False  # the block holds its experts' weights in two children (JetMoE): experts is the block

    @property
    def experts_path(self) -> str:
        if self.self_held:
            return self.path
        return f"{self.path}.{self.experts_name}" if self.path else self.experts_name


def _forward_params(module: nn.Module) -> list[inspect.Parameter]:
    fn = type(module).forward
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return list(inspect.signature(fn).parameters.values())[1:]


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout if ``module`` is an experts holder, else None: ``num_experts``, per-expert weights in
    a layout the runtime knows, and a forward that takes the routing (:func:`takes_routing`) or only
    the hidden rows (:func:`routing_free`; driven by a block-level archetype only). Zero experts
    (:func:`routed_experts`) need the routing: their ids arrive with it."""
    try:
        layout = ExpertsLayout.of(module)
    except (ExpertParallelError, IndexError):
        return None
    if layout.modules:  # per-expert MLP modules of one shape (runtime.expert_modules checked them)
        return layout
    n = routed_experts(module, layout)
    if n is None:
        return None
    rows = {name: len(layout.rows_of(name, range(n), n)) for name in layout.weight_names}
    if not all(w.dim() >= 2 and w.shape[0] == rows[name]
               for name, w in ((name, layout.weight(module, name)) for name in layout.weight_names)):
        return None
    if not takes_routing(module) and (layout.zero_experts or not routing_free(module)):
        return None
    return layout


def routed_experts(module: nn.Module, layout: ExpertsLayout) -> int | None:
    """How many routed (FFN) experts the holder has: its int ``num_experts``, or None. With zero experts
    (the up weight holds more experts than down, LongCat) it is down's count, which ``num_experts`` may
    declare with or without the zero ones (or not at all); the probe confirms the extra ids are identity.
    Experts held as modules: their count; split layouts: the weights' leading dimension."""
    if layout.modules:
        return len(layout.expert_keys)
    if layout.split:
        return layout.weight(module, layout.down).shape[0]
    n = getattr(module, "num_experts", None)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None
    if not layout.zero_experts:
        return n
    routed = layout.weight(module, layout.down).shape[0]
    return routed if n in (None, routed, routed + layout.zero_experts) else None


def _positional(module: nn.Module) -> tuple[int, bool]:
    params = _forward_params(module)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional), any(p.kind == p.VAR_POSITIONAL for p in params)


def takes_routing(module: nn.Module) -> bool:
    """Its forward takes ``(hidden, top_k_index, top_k_weights)`` (three positionals or ``*args``)."""
    n, varargs = _positional(module)
    return n >= 3 or varargs


def routing_free(module: nn.Module) -> bool:
    """Its forward takes the hidden rows only (``forward(hidden)``, e.g. Llama 4's experts): the block
    applies the routing outside it, so only a block-level archetype can drive it."""
    n, varargs = _positional(module)
    return n == 1 and not varargs


def _hidden_size(experts: nn.Module, layout: ExpertsLayout) -> int:
    down = layout.expert_shape(experts, layout.down)
    return down[1] if layout.transposed_of(layout.down) else down[0]


def _is_router(module: nn.Module, num_experts: int, hidden: int) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, nn.Parameter) and tuple(w.shape) == (num_experts, hidden)


def _maps_hidden_to_hidden(module: nn.Module, hidden: int) -> bool:
    """An MLP-like child: some 2-D weight reads H and some 2-D weight writes H."""
    weights = [p for p in module.parameters() if p.dim() == 2]
    reads = any(w.shape[1] == hidden for w in weights)
    writes = any(w.shape[0] == hidden for w in weights)
    return reads and writes and len(weights) >= 2


def analyze_block(path: str, block: nn.Module, experts_name: str) -> BlockStructure:
    """The roles of ``block``'s children around its experts holder ``experts_name`` (``""``: the block
    holds its experts' weights itself, a split layout; its router may then sit inside a child)."""
    experts = getattr(block, experts_name) if experts_name else block
    layout = experts_layout(experts)
    assert layout is not None
    s = BlockStructure(path, block, experts_name, experts, routed_experts(experts, layout),
                       _hidden_size(experts, layout),
                       routing_free=not (layout.modules or layout.split) and not takes_routing(experts),
                       zero_experts=layout.zero_experts, expert_modules=layout.modules,
                       calls_each_expert=layout.modules and not expert_modules.has_own_forward(experts),
                       self_held=layout.split)
    owners = {n.split(".")[0] for n in layout.weight_names} if layout.split else set()
    for name, child in block.named_children():
        if name == experts_name or name in owners:
            continue
        if s.self_held and not any(True for _ in child.parameters()):
            continue  # its activation (the probe confirms the generated forward uses it as the block does)
        if s.router_name is None and _is_router(child, s.num_experts + s.zero_experts, s.hidden_size):
            s.router_name = name
        elif isinstance(child, nn.Linear) and child.out_features == 1 and child.in_features == s.hidden_size:
            s.shared_gate_name = name
        elif s.shared_name is None and experts_layout(child) is None and _maps_hidden_to_hidden(child, s.hidden_size):
            s.shared_name = name
        else:
            s.others.append(name)
    if s.self_held and s.router_name is None:  # a router module around the router Linear (JetMoE's router.layer)
        inside = nested_router(s)
        if inside is not None:
            s.router_name = inside
            s.others.remove(inside.split(".")[0])
    return s


def nested_router(s: BlockStructure) -> str | None:
    """The path of a router ``Linear`` (weight ``[experts, hidden]``) inside another child of the block,
    when no child is one itself (Switch's ``router.classifier``, JetMoE's ``router.layer``): what
    describe-moe names as the router the block's own code calls."""
    if s.router_name is not None:
        return None
    for name, child in s.block.named_children():
        if name == s.experts_name:
            continue
        for sub, m in child.named_modules():
            if sub and isinstance(m, nn.Linear) and _is_router(m, s.num_experts + s.zero_experts, s.hidden_size):
                return f"{name}.{sub}"
    return None


#: the names transformers gives a router's selection bias (DeepSeek-V3's correction bias and its kin)
SELECTION_BIAS_NAMES = ("e_score_correction_bias", "expert_bias")


def router_path(s: BlockStructure) -> str | None:
    """The block's child holding its router (``gate``; ``router`` around AfMoE's ``router.gate``; a child
    named ``gate`` or ``router`` otherwise, as LongCat's, whose router also scores its zero experts)."""
    path = s.router_name or nested_router(s) or next((n for n in ("gate", "router") if n in s.others), None)
    return None if path is None else path.split(".")[0]


def selection_bias(s: BlockStructure) -> tuple[str, str] | None:
    """``(owner path below the block, attribute)`` of the router's selection bias: a tensor named as
    transformers names it, in the router's subtree (DeepSeek-V3's ``gate``, Ernie's
    ``gate.moe_statics``) or on the block itself (MiniMax-M2, AfMoE, LFM2); None when it has none."""
    router = router_path(s)
    owners = [] if router is None else [(f"{router}.{p}" if p else router, m)
                                        for p, m in s.block.get_submodule(router).named_modules()]
    owners.append(("", s.block))
    for path, owner in owners:
        for name in SELECTION_BIAS_NAMES:
            value = getattr(owner, name, None) if name in owner._buffers or name in owner._parameters else None
            if value is not None:
                return path, name
    return None


def describe_expert_modules(s: BlockStructure) -> str | None:
    """One line on experts held as modules: their class and count, the role of each projection and the
    activation (``8 x TinyMoeMLP: gate w1, up w3, down w2, activation silu``); None for 3-D layouts."""
    layout = experts_layout(s.experts)
    if layout is None or not layout.modules:
        return None
    first = s.experts.get_submodule(layout.held[0])
    roles = [f"{role} {name.rsplit('.', 1)[0]}" for role, name in (("gate", layout.gate), ("up", layout.up),
                                                                    ("down", layout.down)) if name]
    kind, act = layout.module_act  # a built-in function, or the expert's own attribute (and its class)
    act = act if kind == "fn" else f"{act} ({type(getattr(first, act)).__name__})"
    return f"{len(layout.expert_keys)} x {type(first).__name__}: {', '.join(roles)}, activation {act}"


def expert_count(module: nn.Module, name: str = "") -> int:
    """How many experts ``module`` holds, judged by structure in any layout; 0 when it holds none.

    An experts holder that follows the contract (:func:`experts_layout`) holds its routed experts.
    Otherwise: a ModuleList / ModuleDict named ``*expert*`` (``name`` is its path) of at least two
    same-typed modules with weights, or a module (not a torch.nn built-in such as Conv1d) with direct
    3-D floating weights sharing a leading dimension of at least 2 (two or more of them, or one in a
    module or class named ``*expert*``; a declared ``num_experts`` among the leading sizes wins), or a
    module taking the routing contract that keeps its experts flat in a child (:func:`_flat_expert_count`).
    """
    layout = experts_layout(module)
    if layout is not None:
        return routed_experts(module, layout)
    leaf = name.rsplit(".", 1)[-1].lower()
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        # per-expert modules: the children that have weights, all of one type (dropouts etc. aside)
        weighted = [c for c in module.children() if any(True for _ in c.parameters())]
        if "expert" in leaf and len(weighted) >= 2 and len({type(c) for c in weighted}) == 1:
            return len(weighted)
        return 0
    if type(module).__module__.startswith("torch.nn"):
        return 0  # Conv1d and friends
    flat = _flat_expert_count(module)
    if flat:
        return flat
    stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3 and p.is_floating_point()]
    leading = {p.shape[0] for p in stacked}
    if not stacked or min(leading) < 2:
        return 0
    if len(stacked) < 2 and "expert" not in type(module).__name__.lower() and "expert" not in leaf:
        return 0  # a lone 3-D tensor (a position table, a custom convolution) is not an experts holder
    declared = getattr(module, "num_experts", None)
    # zero-expert layouts hold more gate/up rows than down rows: the declared count wins
    return declared if isinstance(declared, int) and declared in leading else min(leading)


def _flat_expert_count(module: nn.Module) -> int:
    """``num_experts`` of a holder that takes the routing contract ``(hidden, top_k_index,
    top_k_weights)`` and declares ``num_experts >= 2`` but keeps its expert weights flat in a child
    (2-D ``[num_experts * width, hidden]``, e.g. DBRX's ``mlp.w1/v1/w2``); else 0."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        return 0
    if not takes_routing(module):
        return 0
    weights = [p for _, p in module.named_parameters() if p.is_floating_point()]
    if len(weights) < 2 or any(p.dim() != 2 or p.shape[0] % n or p.shape[0] == n for p in weights):
        return 0
    return n


def find_experts_holders(model: nn.Module, any_layout: bool = False) -> list[tuple[str, nn.Module]]:
    """Every experts holder in ``model``, with its module path: those that follow the experts contract
    (:func:`experts_layout`; what hp-rewrite rewrites), or with ``any_layout`` every module that holds
    experts by structure (:func:`expert_count`: also per-expert module lists and 3-D weights outside
    the contract), holders nested in another one left out."""
    if not any_layout:
        modules = dict(model.named_modules())
        return [(name, m) for name, m in modules.items() if (layout := experts_layout(m)) is not None
                and (not layout.modules or _routed_list(modules, name, m, layout))]
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(h + ".") for h, _ in found):
            continue
        if expert_count(module, name):
            found.append((name, module))
    return found


def _routed_list(modules: dict[str, nn.Module], name: str, container: nn.Module, layout: ExpertsLayout) -> bool:
    """Whether a list of MLP modules sits beside a router: a ``Linear`` with weight ``[len, hidden]``
    elsewhere in its parent (a child, or inside one). A list of dense MLPs (a stack of layers) is no
    experts holder."""
    parent = modules.get(name.rpartition(".")[0]) if name else None
    if parent is None:
        return False
    n, hidden = len(layout.expert_keys), _hidden_size(container, layout)
    inside = {id(m) for m in container.modules()}
    return any(isinstance(m, nn.Linear) and id(m) not in inside and _is_router(m, n, hidden) for m in parent.modules())


def find_blocks(model: nn.Module) -> list[BlockStructure]:
    """One :class:`BlockStructure` per experts holder (its parent is the block)."""
    blocks = []
    for path, holder in find_experts_holders(model):
        if experts_layout(holder).split:  # the block holds its experts itself
            blocks.append(analyze_block(path, holder, ""))
            continue
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        blocks.append(analyze_block(parent_path, parent, attr))
    return blocks
