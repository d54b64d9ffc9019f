"""Time of one MoE layer on its busiest rank: compute at achieved FLOP/s, exchanges alpha-beta.

Exchange time (one all-to-all, one chunk): ``alpha * messages + bytes / beta``, with one message
per peer, the remote bytes split between peers in the node (``beta``, or ``peers * link_Bps`` on a
full mesh) and peers in other nodes (``beta_inter``); EP groups are consecutive ranks, so a group
of ``ep <= devices_per_node`` stays in one node. A rank sends and receives at once, so an exchange
takes as long as its larger direction.

Forward follows the runtime's schedule (``hp_rewrite/runtime/pipeline/dispatch.py``): router, count exchange
(blocking: one host sync), every chunk's dispatch issued at once on the link, the shared expert
computed meanwhile (block-level archetypes only), then per chunk the expert GEMMs as soon as its
rows arrived and its combine queued on the link behind the dispatches, finally the weighted sum.
Backward is twice the compute plus both reverse exchanges, with no overlap modelled. With ``tp > 1``
the MoE layer's TP collectives (``LayerCost.tp_*_bytes``) add to forward and backward, unhidden. The runtime
issues them asynchronously, overlapping whatever autograd runs in between, so this is an upper bound.
Each layer is costed at its busiest rank. Neither ``runtime.defer_expert_grads`` (which lets a
waiting rank compute weight gradients) nor the ``Interleaver`` is modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware
from .per_rank import LayerCost, ModelCost


def exchange_time(remote_bytes: float, ep: int, hw: Hardware) -> float:
    """One all-to-all among ``ep`` ranks moving ``remote_bytes`` off this rank (one direction)."""
    if ep <= 1:
        return 0.0
    in_node = min(ep, hw.devices_per_node) - 1
    off_node = ep - 1 - in_node
    beta_in = hw.beta_Bps if hw.link_Bps is None else min(hw.beta_Bps, max(in_node, 1) * hw.link_Bps)
    per_peer = remote_bytes / (ep - 1)
    return (
        hw.alpha_s * in_node
        + hw.alpha_inter_s * off_node
        + per_peer * in_node / beta_in
        + per_peer * off_node / hw.beta_inter_Bps
    )


@dataclass(frozen=True)
class LayerTime:
    """Seconds on the layer's busiest rank. ``exposed_comm``: time beyond pure compute."""

    compute: float
    comm: float
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward

    @property
    def exposed_comm(self) -> float:
        return max(self.total - self.compute, 0.0)


def forward_schedule(
    router: float,
    counts: float,
    shared: float,
    experts: float,
    combine_mm: float,
    dispatch: float,
    combine: float,
    chunks: int,
    overlap: bool,
    shared_overlaps: bool,
) -> float:
    """Forward time of one layer on one rank for the runtime's schedule (see the module docstring)."""
    c = max(chunks, 1)
    d, g, x = dispatch / c, experts / c, combine / c
    if not overlap:
        return router + counts + dispatch + shared + experts + combine + combine_mm
    t0 = router + counts + (0.0 if shared_overlaps else shared)  # experts level: shared runs before
    arrivals = [t0 + (i + 1) * d for i in range(c)]
    link = t0 + c * d
    compute = t0 + (shared if shared_overlaps else 0.0)
    for i in range(c):
        compute = max(compute, arrivals[i]) + g
        link = max(link, compute) + x
    return max(link, compute) + combine_mm


def tp_collective_time(sent_bytes: float, tp: int, hw: Hardware) -> float:
    """Ring collectives moving ``sent_bytes`` off this rank within its TP group (consecutive ranks: one
    node when ``tp <= devices_per_node``), latency counted once per peer step."""
    if tp <= 1 or sent_bytes <= 0:
        return 0.0
    inside = tp <= hw.devices_per_node
    alpha, beta = (hw.alpha_s, hw.beta_Bps) if inside else (hw.alpha_inter_s, hw.beta_inter_Bps)
    return alpha * (tp - 1) + sent_bytes / beta


def layer_time(cost: LayerCost, hw: Hardware, ep: int, chunks: int = 1, overlap: bool = True,
               tp: int = 1, cp: int = 1) -> LayerTime:
    f, flops = cost.forward, hw.achieved_flops
    router, shared, experts, combine_mm = (
        f.router / flops,
        f.shared / flops,
        f.routed / flops,
        f.combine / flops,
    )
    ex = cost.exchange
    biggest = max(ex.remote_bytes_sent, ex.remote_bytes_received)
    # the combine moves the same rows back, without dedup's side columns
    combine_share = ex.combine_bytes_sent / ex.bytes_received if ex.bytes_received else 1.0
    per_chunk_alpha = exchange_time(0.0, ep, hw)  # latency of one extra chunk's messages
    a2a_dispatch = exchange_time(biggest, ep, hw) + (chunks - 1) * per_chunk_alpha
    a2a_combine = exchange_time(biggest * combine_share, ep, hw) + (chunks - 1) * per_chunk_alpha
    counts = exchange_time(ex.count_bytes, ep, hw)
    fwd = forward_schedule(
        router, counts, shared, experts, combine_mm, a2a_dispatch, a2a_combine, chunks, overlap,
        cost.shared_overlaps_dispatch,
    )
    a2a = a2a_dispatch + a2a_combine
    # TP collectives (gathers, the shared expert's all-reduce): on the critical path, not overlapped
    tp_fwd = tp_collective_time(cost.tp_forward_bytes, tp, hw)
    tp_bwd = tp_collective_time(cost.tp_backward_bytes, tp, hw)
    # Ulysses' all-to-alls within the context group (consecutive ranks): on the critical path, each direction
    ulysses = tp_collective_time(cost.cp_bytes, cp, hw)
    bwd = 2 * (router + shared + experts + combine_mm) + a2a + tp_bwd + ulysses
    compute = 3 * (router + shared + experts + combine_mm)
    return LayerTime(compute=compute, comm=counts + 2 * a2a + tp_fwd + tp_bwd + 2 * ulysses,
                     forward=fwd + tp_fwd + ulysses, backward=bwd)


@dataclass(frozen=True)
class StepTime:
    """Forward + backward of every costed MoE layer for one micro-batch (sum of each layer's busiest rank)."""

    compute: float
    comm: float
    total: float

    @property
    def exposed_comm(self) -> float:
        return max(self.total - self.compute, 0.0)


def step_time(cost: ModelCost, hw: Hardware) -> StepTime:
    times = [layer_time(c, hw, cost.parallel.ep, cost.knobs.chunks, cost.knobs.overlap, cost.parallel.tp,
                        cost.parallel.cp) for c in cost.layers]
    return StepTime(sum(t.compute for t in times), sum(t.comm for t in times), sum(t.total for t in times))
