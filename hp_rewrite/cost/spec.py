"""What the cost model needs to know about a model's MoE layers, read from weight shapes.

Sizes come from the parameters themselves (the experts holder's 3-D weights, the shared expert's
2-D weights, the router's ``[E, H]`` weight), never from config field names, so a family that
names its sizes differently (``moe_intermediate_size``, ``expert_ffn_hidden``, ...) or builds its
shared experts as one fused MLP of ``n_shared * I`` is still read right. Works on a model built on
the meta device: only shapes are touched.

Archetypes (level / router / shared merge / layout) are confirmed by execution where the block is
small enough to materialise; for a big model (DeepSeek-V3: one MoE block is 11 G parameters) they
are confirmed on the same classes built from a shrunk copy of the config (``tiny_config``), and
only the sizes come from the full model. When even that fails the spec is structural only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..hf import top_k_of
from ..match.probe_size import largest_block_params, too_big_to_probe
from ..match.structure import BlockStructure, experts_layout, find_blocks
from ..runtime.routing.routing_load import layer_index


@dataclass(frozen=True)
class MLPShape:
    """One MLP's matmul sizes: ``matmul_params`` = elements of its matmul weights (gate + up + down).

    FLOPs per token row are ``2 * matmul_params`` (= the seed's ``2 * n_ffMM * h * hff``);
    ``params`` adds biases and norms (memory).
    """

    hidden: int
    intermediate: int
    matmul_params: int
    params: int

    @property
    def n_ff(self) -> float:
        """Linear layers of the MLP (3 gated SwiGLU, 2 plain), as the seed's ``n_ffMM``."""
        return self.matmul_params / (self.hidden * self.intermediate) if self.intermediate else 0.0

    @property
    def flops_per_row(self) -> int:
        return 2 * self.matmul_params


@dataclass(frozen=True)
class MoELayerSpec:
    """One MoE block as the cost model sees it.

    confirmed: ``executed`` (archetype confirmed on this block's class by running it),
    ``probe`` (confirmed on the same class built from a shrunk config), ``structural`` (sizes
    only; no archetype).
    """

    path: str
    layer: int | None
    block_class: str
    num_experts: int
    top_k: int
    hidden: int
    routed: MLPShape
    shared: MLPShape | None
    shared_gate: bool
    router_params: int
    archetype: dict | None = None
    confirmed: str = "structural"
    # identity experts after the routed ones (LongCat): their slots cost no expert FLOPs and no exchange
    # bytes; zero_params: elements of their unused gate/up rows, which every rank keeps
    zero_experts: int = 0
    zero_params: int = 0

    @property
    def shared_overlaps_dispatch(self) -> bool:
        """Only the block-level archetype computes the shared expert while the dispatch is in flight."""
        return self.shared is not None and bool(self.archetype) and self.archetype.get("level") == "block"


@dataclass(frozen=True)
class ModelSpec:
    """Every plan-selected MoE layer of a model, plus what lies outside them (for the memory note)."""

    model_type: str
    num_hidden_layers: int | None
    layers: tuple[MoELayerSpec, ...]
    total_params: int
    dtype_bytes: int | None
    excluded: tuple[str, ...] = ()
    unmatched: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def moe_params(self) -> int:
        return sum(
            lay.num_experts * lay.routed.params
            + lay.router_params
            + lay.zero_params
            + (lay.shared.params if lay.shared else 0)
            + (lay.hidden + 1 if lay.shared_gate else 0)
            for lay in self.layers
        )

    @property
    def other_params(self) -> int:
        """Attention, embeddings, norms, dense MLP layers: not costed, replicated on every EP rank."""
        return max(self.total_params - self.moe_params, 0)


def routed_shape(experts: nn.Module, num_experts: int) -> MLPShape:
    """Per-expert sizes from the holder's 3-D weights and its layout (fused, separate, transposed...)."""
    layout = experts_layout(experts)
    if layout is None:
        raise ValueError(f"{type(experts).__name__} is not an experts holder")
    down, down_t = layout.expert_shape(experts, layout.down), layout.transposed_of(layout.down)  # flat: [I, H]
    hidden = down[1] if down_t else down[0]
    inter = down[0] if down_t else down[1]
    mats = [layout.up, layout.down] + ([layout.gate] if layout.gate else [])
    matmul = sum(_per_expert(experts, layout, n) for n in mats)
    params = sum(_per_expert(experts, layout, n) for n in layout.roles)
    return MLPShape(int(hidden), int(inter), int(matmul), int(params))


def _per_expert(experts: nn.Module, layout, name: str) -> int:
    """Elements of one expert's slice of weight ``name`` (zero experts' extra rows left out)."""
    return layout.expert_shape(experts, name).numel()


def zero_params(experts: nn.Module) -> int:
    """Elements of the zero (identity) experts' unused rows (LongCat's extra ``gate_up_proj`` rows)."""
    layout = experts_layout(experts)
    return sum(_per_expert(experts, layout, n) * layout.zero_experts for n in layout.padded_names)


def shared_shape(module: nn.Module, hidden: int) -> MLPShape:
    """Sizes of a shared expert (any MLP that reads and writes H), from its 2-D weights.

    The intermediate size is the input width of the weight(s) that write H (the down projection);
    a shared block of several experts built as one MLP reports their total, so the seed's
    ``hff * n_shared_exp`` is this ``intermediate`` with ``n_shared_exp = 1``.
    """
    weights = [p for p in module.parameters() if p.dim() == 2]
    matmul = sum(w.numel() for w in weights)
    writers = [w for w in weights if w.shape[0] == hidden and w.shape[1] != hidden] or weights[-1:]
    inter = sum(int(w.shape[1]) for w in writers)
    params = sum(p.numel() for p in module.parameters())
    return MLPShape(hidden, inter, int(matmul), int(params))


def _top_k(s: BlockStructure, config) -> int:
    router = s.block.get_submodule(s.router_name) if s.router_name else None
    k = top_k_of(s.block, router, getattr(s.experts, "config", None), config)
    if k is None:
        raise ValueError(f"{s.path}: cannot find the router's top-k (no top_k on the router, block or config)")
    return k


def layer_spec(s: BlockStructure, config, archetype: dict | None, confirmed: str) -> MoELayerSpec:
    router = s.block.get_submodule(s.router_name) if s.router_name else None
    shared = getattr(s.block, s.shared_name) if s.shared_name else None
    return MoELayerSpec(
        path=s.path,
        layer=layer_index(s.path),
        block_class=type(s.block).__name__,
        num_experts=s.num_experts,
        top_k=_top_k(s, config),
        hidden=s.hidden_size,
        routed=routed_shape(s.experts, s.num_experts),
        shared=shared_shape(shared, s.hidden_size) if shared is not None else None,
        shared_gate=s.shared_gate_name is not None,
        router_params=sum(p.numel() for p in router.parameters()) if router is not None else 0,
        archetype=archetype,
        confirmed=confirmed if archetype else "structural",
        zero_experts=s.zero_experts,
        zero_params=zero_params(s.experts),
    )


def _class_key(s: BlockStructure) -> tuple[str, str]:
    return type(s.block).__name__, type(s.experts).__name__


def _archetypes(model: nn.Module, config, plan, blocks: list[BlockStructure]) -> tuple[dict, str, list[str]]:
    """``{(block class, experts class): archetype dict or None}``, how they were confirmed, notes."""
    from ..match.analysis import analyze

    biggest = largest_block_params(s.block for s in blocks)
    if not too_big_to_probe(biggest):
        analysis = analyze(model, plan)
        found = {_class_key(r.structure): r.archetype.as_dict() for r in analysis.matched}
        found.update({_class_key(r.structure): None for r in analysis.unmatched})
        return found, "executed", []
    from ..errors import UserError
    from ..hf import meta_model
    from ..hf.shrink import tiny_config
    from ..plan.schema import ModulesSection, PlacementSection

    try:
        probe = meta_model(tiny_config(config))
        # the shrunk model has other expert counts: the plan's placement loads are not for it
        shrunk_plan = plan.model_copy(update={"modules": ModulesSection(), "placement": PlacementSection()})
        analysis = analyze(probe, shrunk_plan)
    except (UserError, ValueError, RuntimeError) as e:  # TinyError / ModelDirError are UserErrors
        return {}, "structural", [f"archetypes not confirmed: the shrunk probe model failed ({e})"]
    found = {_class_key(r.structure): r.archetype.as_dict() for r in analysis.matched}
    note = (
        f"blocks of up to {biggest / 1e9:.1f} G parameters: archetypes confirmed on a model built "
        "from a shrunk copy of the config (same classes); sizes read from the full model's shapes"
    )
    return found, "probe", [note]


def _dtype_bytes(config) -> int | None:
    import torch

    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


def model_spec(model: nn.Module, config, plan, confirm: bool = True) -> ModelSpec:
    """The plan-selected MoE layers of ``model`` (meta or real). ``confirm=False`` skips archetypes."""
    blocks_all = find_blocks(model)
    selected, excluded = [], []
    for s in blocks_all:
        if plan.matches(s.path, type(s.block).__name__) or plan.matches(
            s.experts_path, type(s.experts).__name__
        ):
            selected.append(s)
        else:
            excluded.append(s.path)
    archetypes, how, notes = (
        ({}, "structural", []) if not confirm else _archetypes(model, config, plan, selected)
    )
    layers, unmatched = [], []
    for s in selected:
        key = _class_key(s)
        if confirm and how == "executed" and archetypes.get(key) is None:
            unmatched.append(s.path)
            continue  # the rewrite leaves it unmodified: not expert-parallel, not costed
        layers.append(layer_spec(s, config, archetypes.get(key), how))
    return ModelSpec(
        model_type=getattr(config, "model_type", "?"),
        num_hidden_layers=getattr(config.get_text_config(decoder=True), "num_hidden_layers", None)
        if hasattr(config, "get_text_config")
        else None,
        layers=tuple(layers),
        total_params=sum(p.numel() for p in model.parameters()),
        dtype_bytes=_dtype_bytes(config),
        excluded=tuple(excluded),
        unmatched=tuple(unmatched),
        notes=tuple(notes),
    )
