"""Find MoE blocks by structure: experts holders, their routers, shared experts and shared gates.

Nothing here looks at model names or reads transformers source text. An *experts holder* is a module
with an integer ``num_experts`` and per-expert weights (dim 0 = experts) in a layout the runtime
knows, whose forward takes ``(hidden, top_k_index, top_k_weights)``. Its parent is the candidate
*block*; the block's other children are classified by their parameter shapes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

from ..runtime import ExpertParallelError, ExpertsLayout


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

    @property
    def experts_path(self) -> str:
        return f"{self.path}.{self.experts_name}" if self.path else self.experts_name


def _forward_params(module: nn.Module) -> list[inspect.Parameter]:
    fn = type(module).forward
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return list(inspect.signature(fn).parameters.values())[1:]


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout if ``module`` is an experts holder following the transformers contract, else None."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    try:
        layout = ExpertsLayout.of(module)
    except ExpertParallelError:
        return None
    weights = [getattr(module, name) for name in layout.weight_names]
    if not all(w.dim() >= 2 and w.shape[0] == n for w in weights):
        return None
    params = _forward_params(module)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return layout


def _hidden_size(experts: nn.Module, layout: ExpertsLayout) -> int:
    down = getattr(experts, layout.down)
    return down.shape[2] if layout.transposed else down.shape[1]


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
    experts = getattr(block, experts_name)
    layout = experts_layout(experts)
    assert layout is not None
    s = BlockStructure(path, block, experts_name, experts, experts.num_experts, _hidden_size(experts, layout))
    for name, child in block.named_children():
        if name == experts_name:
            continue
        if s.router_name is None and _is_router(child, s.num_experts, s.hidden_size):
            s.router_name = name
        elif isinstance(child, nn.Linear) and child.out_features == 1 and child.in_features == s.hidden_size:
            s.shared_gate_name = name
        elif s.shared_name is None and experts_layout(child) is None and _maps_hidden_to_hidden(child, s.hidden_size):
            s.shared_name = name
        else:
            s.others.append(name)
    return s


def find_experts_holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every experts holder in ``model``, with its module path."""
    return [(name, m) for name, m in model.named_modules() if experts_layout(m) is not None]


def find_blocks(model: nn.Module) -> list[BlockStructure]:
    """One :class:`BlockStructure` per experts holder (its parent is the block)."""
    blocks = []
    for path, _ in find_experts_holders(model):
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        blocks.append(analyze_block(parent_path, parent, attr))
    return blocks
