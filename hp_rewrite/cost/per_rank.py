"""Per-rank, per-MoE-layer cost: FLOPs, all-to-all volume and memory, for one parallel setting.

``estimate(spec, parallel, workload)`` costs every MoE layer of a :class:`ModelSpec` on one rank:
by default the *busiest* EP rank of each layer (the one receiving the most routed rows; every rank
waits for it at the combine all-to-all), or a given ``rank`` (used to check against what each
gloo rank actually did). Forward FLOPs and bytes are computed; backward is the mirror image
(2x the FLOPs; the same bytes through the reverse exchanges).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import formulas
from .routing import Histograms, RankLoads, rank_loads
from .spec import ModelSpec, MoELayerSpec

COUNT_BYTES = 8  # the runtime exchanges int64 split sizes
# dedup: each row carries, per slot, one column (in the activations' dtype) per byte of its routing weight
# (fp32 at most) and of its int16 local expert id (runtime/transport/rows.py pack_rows)
SIDE_COLUMNS_PER_SLOT = 4 + 2


@dataclass(frozen=True)
class Parallel:
    """ep: expert parallel; tp: hp-rewrite's tensor parallelism (the plan's ``tp_size``: a TP group of
    ``tp`` ranks shares one micro-batch, splits the shared expert and the dense parts, and each rank
    routes ``1/tp`` of the group's tokens to complete experts over the TP-extended EP group);
    sequence_parallel: the plan's; etp: expert tensor parallel (the seed's, not implemented by the
    runtime: it only divides expert FLOPs and weights here); cp: the plan's ``cp_size`` (a context group of
    ``cp`` ranks shares one micro-batch and each holds ``1/cp`` of its tokens; attention exchanges heads for
    positions, see ``LayerCost.cp_bytes``)."""

    ep: int = 1
    etp: int = 1
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("ep", "etp", "tp", "cp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")

    @property
    def t_exp(self) -> int:
        """What divides an expert's FLOPs and weights: only expert tensor parallelism (TP never splits
        experts: MindSpeed's TP-extend-EP, Megatron's etp=1)."""
        return self.etp


@dataclass(frozen=True)
class Workload:
    """One micro-batch per rank: ``micro_batch`` sequences of ``seq_len`` tokens (before cp)."""

    seq_len: int
    micro_batch: int

    def tokens(self, cp: int = 1) -> float:
        return self.seq_len * self.micro_batch / cp


@dataclass(frozen=True)
class Precision:
    """Bytes per element. ``act``: hidden states exchanged and saved; ``param``/``grad``: weights and
    their gradients; ``optimizer``: Adam's two fp32 moments; ``master``: an fp32 master copy when
    the weights are in 16 bits (mixed precision)."""

    act: int = 2
    param: int = 2
    grad: int = 2
    optimizer: int = 8
    master: int = 4
    lora_rank: int = 0  # > 0: a frozen base, LoRA of this rank on the routed experts (fp32 adapters, AdamW)
    expert_weight: float | None = None  # bytes per routed-expert value as held (kept MXFP4 / FP8); None: param

    @property
    def expert_weight_bytes(self) -> float:
        return self.param if self.expert_weight is None else self.expert_weight

    @classmethod
    def of(cls, dtype_bytes: int) -> Precision:
        return cls(
            act=dtype_bytes,
            param=dtype_bytes,
            grad=dtype_bytes,
            optimizer=8,
            master=4 if dtype_bytes < 4 else 0,
        )

    @property
    def state_bytes(self) -> int:
        """Bytes per trained parameter: weight + gradient + Adam moments (+ master copy)."""
        return self.param + self.grad + self.optimizer + self.master


@dataclass(frozen=True)
class Knobs:
    """Runtime knobs that change the cost (from the plan's ``runtime:`` and ``placement:`` sections).

    placement_loads: per MoE block path, the loads a balanced placement spreads (None: contiguous).
    dedup: one row per (token, destination rank) instead of one per routed slot (``runtime.dedup``).
    """

    chunks: int = 1
    overlap: bool = True
    capacity_factor: float | None = None
    placement_loads: dict | None = None
    dedup: bool = True

    @classmethod
    def from_plan(cls, plan) -> Knobs:
        rt = plan.runtime
        balanced = plan.placement.strategy == "balanced"
        return cls(chunks=rt.chunks, overlap=rt.overlap, capacity_factor=rt.capacity_factor,
                   placement_loads=dict(plan.placement.loads) if balanced else None, dedup=rt.dedup)

    def owners(self, path: str, num_experts: int, ep: int) -> tuple[tuple[int, ...], ...] | None:
        """Each EP rank's experts of the block at ``path`` (None: consecutive blocks of experts)."""
        if self.placement_loads is None or num_experts % ep:
            return None  # contiguous, or an ep that cannot hold these experts at all
        from ..runtime.errors import ExpertParallelError
        from ..runtime.group.groups import ExpertPlacement

        loads = self.placement_loads.get(path)
        if loads is None or len(loads) != num_experts:  # the same refusal as installing the plan
            raise ExpertParallelError(
                f"placement: the routing loads have no entry with {num_experts} experts for the MoE block "
                f"{path}; record them on this model with `hp-rewrite profile`, or use strategy: contiguous"
            )

        placement = ExpertPlacement.balanced(loads, ep, 0)
        return tuple(placement.experts_of(r) for r in range(ep))


@dataclass(frozen=True)
class LayerFlops:
    router: float
    routed: float
    combine: float
    shared: float

    @property
    def total(self) -> float:
        return self.router + self.routed + self.combine + self.shared

    def scaled(self, factor: float) -> LayerFlops:
        return LayerFlops(
            self.router * factor, self.routed * factor, self.combine * factor, self.shared * factor
        )


@dataclass(frozen=True)
class Exchange:
    """All-to-all volume of one rank for one layer, dispatch direction, counted like the runtime's
    ``DispatchStats``: rows to and from *this rank itself included* (the runtime hands them to
    ``all_to_all_single`` like any other). The combine moves the same rows back (sent and received
    swap; ``combine_bytes_*``, without the dedup side columns); backward repeats both through the
    reverse exchanges. ``remote_*`` leave out the rows a rank keeps (what crosses a link; the time
    model uses these). ``count_bytes``: the split-size exchange, once per layer (int64 per chunk and
    expert, plus one per chunk and rank with dedup, sent and received). ``estimated``: the rows are an
    estimate (dedup: which experts share a token is not in a histogram), not a count."""

    rows_sent: float
    rows_received: float
    bytes_sent: float
    bytes_received: float
    remote_bytes_sent: float
    remote_bytes_received: float
    count_bytes: float
    combine_bytes_sent: float = 0.0
    combine_bytes_received: float = 0.0
    estimated: bool = False

    @property
    def forward_bytes(self) -> float:
        """Bytes this rank sends in one forward: dispatch + combine (it receives the same total)."""
        return self.bytes_sent + self.combine_bytes_sent

    @property
    def step_bytes(self) -> float:
        """Forward and backward: every exchange has its reverse."""
        return 2 * self.forward_bytes


@dataclass(frozen=True)
class LayerMemory:
    """Bytes on one rank for one layer. ``expert_*``: its ``E/ep`` routed experts (divided by t_exp);
    ``replicated_*``: router, shared expert and shared gate (every EP rank holds them);
    ``activations``: what the backward keeps (see docs/cost-model.md)."""

    expert_params: float
    expert_grads: float
    expert_optimizer: float
    replicated_params: float
    replicated_grads: float
    replicated_optimizer: float
    activations: float

    @property
    def states(self) -> float:
        return (
            self.expert_params
            + self.expert_grads
            + self.expert_optimizer
            + self.replicated_params
            + self.replicated_grads
            + self.replicated_optimizer
        )

    @property
    def total(self) -> float:
        return self.states + self.activations


@dataclass(frozen=True)
class LayerCost:
    path: str
    layer: int | None
    rank: int
    local_experts: int
    loads: RankLoads
    forward: LayerFlops
    backward: LayerFlops
    exchange: Exchange
    memory: LayerMemory
    shared_overlaps_dispatch: bool
    tp_forward_bytes: float = 0.0  # sent by this rank in the layer's TP collectives, forward
    tp_backward_bytes: float = 0.0  # ... and backward
    cp_bytes: float = 0.0  # sent off this rank by the decoder layer's Ulysses exchanges (cp > 1), per direction

    @property
    def step_flops(self) -> float:
        return self.forward.total + self.backward.total


@dataclass(frozen=True)
class ModelCost:
    model_type: str
    parallel: Parallel
    workload: Workload
    precision: Precision
    knobs: Knobs
    layers: tuple[LayerCost, ...]
    other_params: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def forward_flops(self) -> float:
        return sum(c.forward.total for c in self.layers)

    @property
    def backward_flops(self) -> float:
        return sum(c.backward.total for c in self.layers)

    @property
    def step_bytes(self) -> float:
        return sum(c.exchange.step_bytes for c in self.layers)

    @property
    def memory(self) -> float:
        return sum(c.memory.total for c in self.layers)

    @property
    def max_imbalance(self) -> float:
        return max((c.loads.imbalance for c in self.layers), default=1.0)

    def as_dict(self) -> dict:
        d = asdict(self)
        loads = d["knobs"].pop("placement_loads")  # the loads are the plan's; say which placement ran
        d["knobs"]["placement"] = "contiguous" if loads is None else "balanced"
        d["totals"] = {
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "step_flops": self.forward_flops + self.backward_flops,
            "step_a2a_bytes": self.step_bytes,
            "memory_bytes": self.memory,
            "max_imbalance": self.max_imbalance,
        }
        for lay, c in zip(d["layers"], self.layers, strict=True):
            lay["loads"]["imbalance"] = c.loads.imbalance
            lay["memory"]["total"] = c.memory.total
            lay["exchange"]["step_bytes"] = c.exchange.step_bytes
        return d


def hit_probability(share: float, num_experts: int, top_k: int) -> float:
    """Chance that a token has at least one of its ``top_k`` experts on a rank that receives ``share``
    of all routed slots: drawn without replacement from ``num_experts`` equally likely experts, of
    which ``share * num_experts`` count as the rank's. Exact for uniform routing; with skew it is the
    same formula on the rank's share (which experts co-occur in one token is not in a histogram)."""
    outside = (1.0 - share) * num_experts
    miss = 1.0
    for i in range(min(top_k, num_experts)):
        miss *= max(outside - i, 0.0) / (num_experts - i)
    return 1.0 - miss


def _activations(lay: MoELayerSpec, tokens: float, rows: float, act: int) -> float:
    """Saved for backward: the block input (shared by router and shared expert), fp32 router scores,
    the received rows and the expert MLP's intermediate outputs, the k expert outputs per token
    kept by the weighted-sum bmm, and the shared expert's intermediates."""
    h = lay.hidden
    routed = rows * (h + lay.routed.n_ff * lay.routed.intermediate)
    shared = tokens * lay.shared.n_ff * lay.shared.intermediate if lay.shared else 0.0
    elems = tokens * h + routed + tokens * lay.top_k * h + shared
    return elems * act + tokens * (lay.num_experts + lay.zero_experts) * 4


def lora_params(mlp, rank: int) -> float:
    """LoRA parameters on one expert's fused weights (PEFT ``target_parameters``): ``rank * (in + out)``
    for the first projection (gate and up) and for down: ``rank * (2 h + n_ff * i)``."""
    return rank * (2 * mlp.hidden + mlp.n_ff * mlp.intermediate)


def _memory(
    lay: MoELayerSpec, par: Parallel, prec: Precision, local: int, tokens: float, rows: float
) -> LayerMemory:
    expert = local * lay.routed.params / par.t_exp
    replicated = (
        lay.router_params
        + (lay.shared.params / max(par.tp, par.t_exp) if lay.shared else 0)
        + (lay.hidden + 1 if lay.shared_gate else 0)
        + lay.zero_params  # the zero experts' unused rows, on every rank
    )
    if prec.lora_rank:  # frozen base: its weights only; fp32 adapter, gradient and AdamW moments
        w = lay.routed  # kept quantised: the matmul weights as stored, biases in the model's dtype
        held = local * (w.matmul_params * prec.expert_weight_bytes + (w.params - w.matmul_params) * prec.param)
        adapters = local * lora_params(w, prec.lora_rank) / par.t_exp
        return LayerMemory(held / par.t_exp + adapters * 4, adapters * 4, adapters * 8,
                           replicated * prec.param, 0.0, 0.0, _activations(lay, tokens, rows, prec.act))
    return LayerMemory(
        expert * prec.param,
        expert * prec.grad,
        expert * (prec.optimizer + prec.master),
        replicated * prec.param,
        replicated * prec.grad,
        replicated * (prec.optimizer + prec.master),
        _activations(lay, tokens, rows, prec.act),
    )


def layer_cost(
    lay: MoELayerSpec,
    par: Parallel,
    work: Workload,
    prec: Precision | None = None,
    knobs: Knobs | None = None,
    histogram=None,
    rank: int | None = None,
) -> LayerCost:
    """Cost of one MoE layer on EP rank ``rank`` (None: the busiest rank)."""
    prec = prec or Precision()
    knobs = knobs or Knobs()
    group_tokens, k, ep = work.tokens(par.cp), lay.top_k, par.ep
    tokens = group_tokens / par.tp  # this rank's share of its TP group's tokens: what it dispatches
    loads = rank_loads(histogram, lay.num_experts, ep, tokens, k, knobs.capacity_factor,
                       knobs.owners(lay.path, lay.num_experts, ep), lay.zero_experts)
    r = loads.busiest_rank if rank is None else rank
    if not 0 <= r < ep:
        raise ValueError(f"rank {r} outside the EP group of {ep}")
    rows, kept = loads.rows[r], sum(loads.rows)
    row_bytes = lay.hidden * prec.act
    dedup = knobs.dedup and ep > 1
    fwd = LayerFlops(
        # every rank of a TP group routes all its tokens (whole router gradients, no reduction)
        router=formulas.router_flops(group_tokens, lay.hidden, lay.num_experts + lay.zero_experts),
        routed=formulas.expert_flops(rows, lay.routed, par.t_exp),
        # dedup: the owning rank weights and adds its received (row, expert) outputs
        combine=2.0 * rows * lay.hidden if dedup else formulas.combine_flops(tokens, k, lay.hidden),
        shared=formulas.shared_flops(group_tokens, lay.shared, lay.shared_gate, max(par.tp, par.t_exp)),
    )
    counts = COUNT_BYTES * knobs.chunks * (lay.num_experts + (ep if dedup else 0)) if ep > 1 else 0
    if dedup:  # one row per (token, destination rank), carrying its side columns
        kept_share = kept / (ep * tokens * k) if tokens and k else 0.0
        hits = [hit_probability(x / kept if kept else 1.0 / ep, lay.num_experts, k) * kept_share for x in loads.rows]
        sent, received = tokens * sum(hits), ep * tokens * hits[r]
        remote_sent = sent - tokens * hits[r]
        dispatch_row = row_bytes + k * SIDE_COLUMNS_PER_SLOT * prec.act
    else:  # one row per routed slot; every rank routes like the histogram: its share of the kept slots
        sent, received = kept / ep, rows
        remote_sent = sent * (1 - (rows / kept if kept else 1.0 / ep))
        dispatch_row = row_bytes
    exchange = Exchange(
        rows_sent=sent,
        rows_received=received,
        bytes_sent=sent * dispatch_row,
        bytes_received=received * dispatch_row,
        remote_bytes_sent=remote_sent * dispatch_row,
        remote_bytes_received=received * (ep - 1) / ep * dispatch_row,
        count_bytes=counts,
        combine_bytes_sent=received * row_bytes,
        combine_bytes_received=sent * row_bytes,
        estimated=dedup,
    )
    local = lay.num_experts // ep if lay.num_experts % ep == 0 else lay.num_experts / ep
    return LayerCost(
        path=lay.path,
        layer=lay.layer,
        rank=r,
        local_experts=local,
        loads=loads,
        forward=fwd,
        backward=fwd.scaled(2.0),
        exchange=exchange,
        memory=_memory(lay, par, prec, local, tokens, rows),
        shared_overlaps_dispatch=lay.shared_overlaps_dispatch,
        **_tp_bytes(lay, par, group_tokens * lay.hidden * prec.act),
        cp_bytes=_cp_bytes(lay, par, group_tokens * lay.hidden * prec.act),
    )


def _cp_bytes(lay: MoELayerSpec, par: Parallel, block_bytes: float) -> float:
    """Bytes this rank sends off in its decoder layer's Ulysses all-to-alls, forward (the backward sends
    the same again): query, key, value in and the output back, each this rank's ``[tokens / cp, width]``
    of which ``(cp - 1) / cp`` leaves it; with TP its ``heads / tp`` only. Counted at the model width (GQA's
    narrower key / value: an upper bound). The decoder's one gather of the last hidden state per forward is
    left out (once a model)."""
    if par.cp == 1:
        return 0.0
    return 4 * block_bytes * (par.cp - 1) / par.cp / par.tp


def _tp_bytes(lay: MoELayerSpec, par: Parallel, block_bytes: float) -> dict[str, float]:
    """Bytes this rank sends in the MoE layer's TP collectives (ring: ``(tp - 1) / tp`` of the tensor
    per all-gather, twice that per all-reduce), forward and backward. ``block_bytes``: the layer's
    ``[tokens, hidden]`` of its TP group. Forward: the routed output gathered; under SP the input
    gathered too; the shared expert's output all-reduced. Backward: the shares' gradients gathered
    (and under SP the output's, and the saved input chunk gathered again); the shared expert's input
    gradient all-reduced."""
    if par.tp == 1:
        return {}
    unit = block_bytes * (par.tp - 1) / par.tp
    sp, shared = int(par.sequence_parallel), 2 * int(lay.shared is not None)
    return {"tp_forward_bytes": unit * (1 + sp + shared), "tp_backward_bytes": unit * (1 + 2 * sp + shared)}


def estimate(
    spec: ModelSpec,
    par: Parallel,
    work: Workload,
    prec: Precision | None = None,
    knobs: Knobs | None = None,
    histograms: Histograms | None = None,
    rank: int | None = None,
) -> ModelCost:
    """Cost of every MoE layer of ``spec`` (busiest rank of each layer unless ``rank`` is given)."""
    prec = prec or (Precision.of(spec.dtype_bytes) if spec.dtype_bytes else Precision())
    knobs = knobs or Knobs()
    histograms = histograms or Histograms()
    layers = tuple(
        layer_cost(lay, par, work, prec, knobs, histograms.for_layer(lay.path), rank) for lay in spec.layers
    )
    return ModelCost(spec.model_type, par, work, prec, knobs, layers, spec.other_params, spec.notes)
