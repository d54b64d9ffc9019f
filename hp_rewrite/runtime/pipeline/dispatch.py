"""The routed pipeline: dispatch -> local experts -> combine, one-call or two-phase, chunked or not.

Order of work for one MoE layer on one rank (``T`` local tokens, top-k ``K``, ``E`` experts):

1. capacity (optional): drop slots beyond each expert's capacity (same on every path);
2. per chunk: sort the ``T*K`` routed slots by the placement slot of their expert (owner rank, then
   local row; with the default placement the slot is the expert id), so rows are in (destination
   rank, expert) order;
3. count exchange: every rank learns how many rows each source sends to each of its experts, for all
   chunks at once; :func:`dispatch` returns here. The grouped GEMMs' offsets are computed from the
   received counts on the device: the layer uploads nothing;
4. at :func:`experts_and_combine` (after the block queued its shared expert, :func:`shared_beside`):
   one host read of every split size of the layer, then the token exchanges (async when ``overlap``):
   rows travel to the ranks that own their experts;
5. local experts: received rows are regrouped expert-major and run through grouped GEMMs;
6. reverse exchange, and on the sending rank ``sum_k weight[t,k] * y[t,k]`` (one batched matmul),
   accumulated in the promoted dtype of (outputs, weights) and cast back to the hidden dtype, like
   transformers' ``grouped_mm`` path. The weights multiply expert *outputs* on the sender, so the router gradient is
   exact.

At ep 1 there is nothing to exchange: steps 3-4 and chunking are skipped, every slot is a row and the
grouped GEMMs take their offsets on the device, so the layer has no host value at all
(:class:`~.exchange.OnRankExchange`; ``torch.compile(fullgraph=True)`` traces it whole).

Steps 2 and 4-6 differ between the per-slot exchange and the deduplicated one (``options.dedup``,
the default at ep > 1: one row per (token, destination rank), weighted and summed on the owning rank):
each is a :class:`~.exchange.TokenExchange`, chosen once per layer (:func:`~.exchange.exchange_for`).
What the exchanges do where they block (the micro-batch turn, deferred weight gradients) comes from
the layer's :class:`~.context.ExchangeRuntime`.

Two-phase use (the shared expert is queued before the host read and overlaps the exchange)::

    state = dispatch(x, indices, weights, binding=ExpertParallelBinding.for_experts(E, ep, opts))
    shared = shared_beside(state, shared_expert, x)
    routed = experts_and_combine(state, experts)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ...kernels import npu_permute
from .. import installed
from ..balance import replicas
from ..balance.decide import Decision, decide
from ..compute.batch import LocalBatch
from ..compute.experts import holder_of
from ..errors import ExpertParallelError
from ..group import tokens
from ..group.groups import ExpertParallelGroup, ExpertPlacement
from ..options import RuntimeOptions
from ..overlap.deferred import WeightGradQueue
from ..transport import comm
from ..transport.exchange import ON_RANK, PER_SLOT, Chunk, TokenExchange, exchange_for
from .capacity import apply_capacity, count_per_expert
from .layer import ExpertParallelBinding
from .zero_experts import split_zero_experts


@dataclass
class DispatchStats:
    """What one layer's dispatch did. Tensors stay on the device (no extra host sync); ints are host
    values already known from the split-size sync.

    tokens_per_expert: [E] slots this rank routed to each expert (after capacity).
    dropped_per_expert: [E] slots this rank dropped for capacity (zeros when dropless).
    rows_sent / rows_received: rows this rank sent / received in the dispatch exchange (to and from
        itself included; with dedup one per (token, destination rank)); the combine exchange moves the
        same counts back. At ep 1 every routed slot is a row (dropped ones too, zeroed).
    bytes_sent / bytes_received: the same in bytes, dispatch direction (with dedup each row also carries
        its 2k side values; the combine rows do not).
    """

    tokens_per_expert: torch.Tensor
    dropped_per_expert: torch.Tensor
    rows_sent: int = 0
    rows_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rank_rows: torch.Tensor | None = None  # [2, ep] slots sent to each rank's experts: as placed, as computed
    lent: int = 0  # runtime.balance: experts whose weights this rank lent / computed for another rank
    guests: int = 0
    # runtime.balance: bytes of this rank's lent experts as they travel (weights, or codes and scales, and
    # LoRA factors), and of their gradients coming back to it in the backward
    lent_bytes: int = 0
    lent_grad_bytes: int = 0


@dataclass(frozen=True)
class Link:
    """Where one layer's exchanges go and what they do where they block (the hooks are passed in).

    The exchanges start here, in this module's frames (``torch.compile`` breaks its graphs where it
    always did); a :class:`~.exchange.TokenExchange` only says what to send."""

    group: dist.ProcessGroup | None
    size: int
    overlap: bool
    hooks: comm.WaitHooks = comm.NO_HOOKS


@dataclass
class Counted:
    """Phase 1: the counts are exchanged, the split sizes not read yet; what :func:`_launch` needs."""

    bounds: list[slice]
    plans: list
    rows_per_dest: torch.Tensor  # [chunks, ep] rows this rank sends to each rank, on the device
    recv: torch.Tensor  # [src, chunks, cell] count cells received, on the device
    hidden: torch.Tensor
    slots: torch.Tensor  # placement slots, or with runtime.balance virtual ones (.balance.decide)
    weights: torch.Tensor
    width: int  # slots per rank: the local experts, + guest slots with runtime.balance
    decision: Decision | None = None  # runtime.balance: what moves where


@dataclass
class Launched:
    """Phase 2: the split sizes read (the layer's one host sync), every chunk's token exchange started
    (at ep 1 with nothing to exchange, the one on-rank chunk: a dispatch starts here)."""

    chunks: list[Chunk]


class Combined:
    """Phase 3: the local experts ran and the rows came back; the state is spent."""


COMBINED = Combined()


@dataclass
class RoutedDispatch:
    """One layer's dispatch between :func:`dispatch` and :func:`experts_and_combine`: what it was made
    with (``binding``), what it decided once (the exchange, where its collectives go, where weight
    gradients queue) and where it is (``phase``: :class:`Counted` -> :class:`Launched` ->
    :class:`Combined`)."""

    binding: ExpertParallelBinding
    phase: Counted | Launched | Combined
    num_tokens: int
    top_k: int
    hidden_shape: torch.Size
    hidden_dtype: torch.dtype
    weights: torch.Tensor
    stats: DispatchStats
    exchange: TokenExchange  # per slot or deduplicated: chosen once per layer
    link: Link  # the EP group and what the exchanges do where they block
    weight_grads: WeightGradQueue | None = None  # where expert weight gradients queue (defer_expert_grads)
    identity: torch.Tensor | None = None  # [T, H] zero (identity) experts' weighted sum, taken locally
    tp_tokens: int | None = None  # under TP: the group's token count; only this rank's share was sent
    beside: list = field(default_factory=list)  # side streams the current one waits for (:func:`shared_beside`)

    @property
    def ep(self) -> ExpertParallelGroup:
        return self.binding.ep

    @property
    def options(self) -> RuntimeOptions:
        return self.binding.options

    @property
    def placement(self) -> ExpertPlacement:
        return self.binding.placement


def _chunk_bounds(num_tokens: int, chunks: int) -> list[slice]:
    base, extra = divmod(num_tokens, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append(slice(start, end))
        start = end
    return bounds


def dispatch(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, *,
             binding: ExpertParallelBinding) -> RoutedDispatch:
    """Start the routed exchange of ``hidden [T,H]`` by ``indices/weights [T,K]`` (global expert ids).

    ``binding``: the layer's :class:`~.layer.ExpertParallelBinding`, an installed holder's
    (``binding_of``, what generated code passes) or one built for the call
    (:meth:`~.layer.ExpertParallelBinding.for_experts`): its EP group, its placement (the one the
    experts were sharded with), its options, the deferred-gradient queue and turn hook the exchanges
    get, and its identity experts (ids ``num_experts ..`` up to ``num_experts + zero_experts``, summed
    here as ``w * x`` and added at the combine: :mod:`.zero_experts`).
    """
    num_experts, ep, options, placement = binding.num_experts, binding.ep, binding.options, binding.placement
    zero_experts, runtime = binding.zero_experts, binding.runtime
    binding.routes.note(indices)  # kept for a recomputation or a recording (runtime.routing.replay)
    # per slot or deduplicated, torch or NPU permutations: decided here once, not along the way
    exchange = exchange_for(options.dedup, ep.size, npu_permute.wanted(options.compute, hidden.device.type))
    n_local = placement.num_local
    hidden = hidden.reshape(-1, hidden.shape[-1])
    tp_tokens = None
    if ep.tp_size > 1:  # the TP group holds the same tokens: each rank sends its share (see .tokens)
        tp_tokens = hidden.shape[0]
        hidden, weights = (tokens.share(t, ep.tp_group, ep.tp_rank, ep.tp_size) for t in (hidden, weights))
        start, end = tokens.bounds(tp_tokens, ep.tp_size, ep.tp_rank)
        indices = indices[start:end]
    num_tokens, top_k = indices.shape
    indices = indices.long()
    identity = None
    if zero_experts:  # ids >= num_experts are identity experts: computed here, never sent
        indices, weights, identity = split_zero_experts(hidden, indices, weights, num_experts)
    if options.capacity_factor is not None:
        capped = apply_capacity(
            indices,
            weights,
            num_experts,
            options.capacity_factor,
            options.drop_policy,
            options.renormalize_kept,
        )
        indices, weights, dropped = capped
    else:
        dropped = torch.zeros(num_experts, dtype=torch.int64, device=indices.device)

    slot_of = None if placement.is_contiguous else placement.slot_table(indices.device)
    slots = indices if slot_of is None else slot_of[indices]  # sort by owner slot, not expert id
    link = Link(ep.group, ep.size, options.overlap, runtime.hooks(options, ep.size))
    if ep.size == 1 and exchange is PER_SLOT:  # nothing to exchange: no counts, no host sync, no chunks
        sentinels = options.capacity_factor is not None or bool(zero_experts)
        per_slot = count_per_expert(slots.reshape(-1), num_experts)
        chunk = ON_RANK.chunk(hidden, slots, per_slot, sentinels)
        stats = DispatchStats(per_slot if slot_of is None else per_slot[slot_of[:num_experts]], dropped)
        stats.rank_rows = per_slot.sum().expand(2, 1)
        stats.rows_sent = stats.rows_received = chunk.send_splits[0]
        stats.bytes_sent = stats.bytes_received = chunk.send_splits[0] * hidden.shape[-1] * hidden.element_size()
        return RoutedDispatch(binding, Launched([chunk]), num_tokens, top_k, hidden.shape, hidden.dtype, weights,
                              stats, ON_RANK, link, identity=identity, tp_tokens=tp_tokens)
    decision, width, placed = None, n_local, None
    if options.balance == "auto":  # rows of the busiest ranks' hottest experts go to idle ranks (..balance)
        placed = count_per_expert(slots.reshape(-1), num_experts)  # per placement slot
        decision = decide(slots, placed, ep.group, ep.rank, options)
        slots, width = decision.slots, decision.width
    bounds = _chunk_bounds(num_tokens, options.chunks)
    counts, plans = [], []
    for b in bounds:
        plans.append(exchange.plan(slots[b], width, ep.size))
        counts.append(count_per_expert(slots[b].reshape(-1), ep.size * width))
    counts_all = torch.stack(counts)  # [chunks, ep * width]
    rows_per_dest, cells = exchange.count_cells(counts_all.view(len(bounds), ep.size, width), plans)
    recv = comm.exchange_counts(cells.transpose(0, 1).contiguous(), link.group, link.hooks)  # [src, chunks, cell]
    per_slot = counts_all.sum(0) if decision is None else placed
    stats = DispatchStats(per_slot if slot_of is None else per_slot[slot_of[:num_experts]], dropped)
    as_placed = per_slot.view(ep.size, n_local).sum(1)
    stats.rank_rows = torch.stack([as_placed, as_placed if decision is None else
                                   counts_all.sum(0).view(ep.size, width).sum(1)])
    counted = Counted(bounds, plans, rows_per_dest, recv, hidden, slots, weights, width, decision)
    return RoutedDispatch(binding, counted, num_tokens, top_k, hidden.shape, hidden.dtype, weights, stats, exchange,
                          link, runtime.queue_for(options, ep.size), identity=identity, tp_tokens=tp_tokens)


def _launch(state: RoutedDispatch, c: Counted) -> tuple[list[Chunk], replicas.Lending | None]:
    """Read the layer's split sizes on the host (its one host sync) and start the token exchanges; with
    runtime.balance, what the holder's call lends (the weights travel from inside it: :mod:`..balance.replicas`).

    Called by :func:`experts_and_combine`, so whatever the block queues between :func:`dispatch` and
    it (the shared expert, :func:`shared_beside`) is on the device before the host waits."""
    ep, exchange, link, top_k = state.ep, state.exchange, state.link, state.top_k
    n_local, n_chunks, width = c.width, len(c.bounds), c.recv.shape[-1]  # n_local: slots per rank, guests included
    lending = c.decision.host_values() if c.decision is not None else []
    host = torch.cat([c.rows_per_dest.reshape(-1), c.recv.reshape(-1), *lending]).tolist()  # the split sizes
    send_host, recv_host = host[: n_chunks * ep.size], host[n_chunks * ep.size : n_chunks * ep.size + c.recv.numel()]
    local_ends = c.recv[:, :, :n_local].sum(0).cumsum(-1).to(torch.int32)  # [chunks, local]: on the device
    stats, chunks = state.stats, []
    for i, b in enumerate(c.bounds):
        send_splits = send_host[i * ep.size : (i + 1) * ep.size]
        cells = [recv_host[(s * n_chunks + i) * width : (s * n_chunks + i + 1) * width] for s in range(ep.size)]
        local_counts = [sum(cell[e] for cell in cells) for e in range(n_local)]
        chunk = Chunk(b, send_splits, exchange.recv_splits(cells, n_local), local_counts, offsets=local_ends[i])
        for x in exchange.send(chunk, c.plans[i], c.hidden[b], c.slots[b], c.weights[b], c.recv[:, i, :], top_k,
                               n_local, ep.size):
            chunk.exchanges.append(
                comm.exchange(x, chunk.recv_splits, chunk.send_splits, link.group, link.overlap, link.hooks)
            )
        stats.rows_sent += sum(chunk.send_splits)
        stats.rows_received += sum(chunk.recv_splits)
        chunks.append(chunk)
    row_bytes = c.hidden.shape[-1] * c.hidden.element_size() + exchange.side_bytes(top_k, c.weights.dtype, c.hidden.dtype)
    stats.bytes_sent = stats.rows_sent * row_bytes
    stats.bytes_received = stats.rows_received * row_bytes
    if not lending:
        return chunks, None
    sends, recvs = host[-1 - 2 * ep.size : -1 - ep.size], host[-1 - ep.size : -1]
    dtype = torch.get_autocast_dtype(c.hidden.device.type) if torch.is_autocast_enabled(c.hidden.device.type) \
        else None
    stats.lent, stats.guests = sum(sends), sum(recvs)  # anything moves (the same on every rank): all or none lend
    return chunks, replicas.Lending(state.placement.num_local, host[-1] > 0, c.decision.send_local, sends, recvs,
                                    link, dtype, stats)


def shared_beside(state: RoutedDispatch, module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """``module(*args)`` (the shared expert), queued before the layer's one host read.

    On a CUDA or NPU device with an exchange to overlap it runs on a side stream: the host's wait for
    the split sizes then waits for the count exchange only, and the token all-to-all, which NCCL
    starts after everything queued before it on the current stream, does not wait for the shared
    expert either. :func:`experts_and_combine` makes the current stream wait for the side stream
    before it returns. Elsewhere (CPU, ep 1, ``overlap: false``, inside ``torch.compile``) a plain call."""
    device = args[0].device
    if not isinstance(state.phase, Counted) or not state.options.overlap or device.type not in ("cuda", "npu") \
            or torch.compiler.is_compiling():
        return module(*args)
    streams = torch.get_device_module(device)
    main, side = streams.current_stream(device), state.binding.runtime.side_stream(device)
    side.wait_stream(main)
    with streams.stream(side):
        out = module(*args)
    for a in args:  # read on the side stream: their memory is not reused before it is done
        a.record_stream(side)
    for t in (out,) if isinstance(out, torch.Tensor) else out:  # made on the side stream, used on the current
        if isinstance(t, torch.Tensor):
            t.record_stream(main)
    state.beside.append(side)
    return out


def _run_experts(experts: nn.Module, batch: LocalBatch, via_call: bool) -> torch.Tensor:
    if via_call and holder_of(experts) is not None:
        # through __call__ (of a wrapper too): FSDP and other module hooks fire, PEFT adapters apply
        return experts(batch)
    return replicas.local_forward(experts, batch, installed.layout(experts))


def experts_and_combine(state: RoutedDispatch, experts: nn.Module, *, via_call: bool = True) -> torch.Tensor:
    """Run the local experts on the received rows, send results back and combine them: ``[T, H]``.

    Chunk c's experts run while chunk c+1's dispatch and chunk c-1's combine are in flight.
    """
    if isinstance(state.phase, Combined):
        raise RuntimeError("experts_and_combine called twice on the same dispatch state")
    holder = holder_of(experts)
    binding = installed.binding(holder) if holder is not None else None
    if binding is not None and binding.placement != state.placement:
        # rows were sent to the ranks of another placement: they would meet the wrong experts
        raise ValueError(
            f"{type(experts).__name__} holds the experts {list(binding.placement.local_experts)}, but the "
            f"dispatch sent this rank the rows of {list(state.placement.local_experts)}: pass "
            "binding=binding_of(experts) to dispatch"
        )
    phase, state.phase = state.phase, COMBINED  # spent even if what follows raises
    decision = phase.decision if isinstance(phase, Counted) else None
    if decision is not None:
        why = replicas.refusal(experts, holder)
        if why:
            raise ExpertParallelError(f"runtime.balance: auto: {why}. Set runtime.balance: off")
    chunks, lending = _launch(state, phase) if isinstance(phase, Counted) else (phase.chunks, None)
    width = phase.width if isinstance(phase, Counted) else state.placement.num_local
    installed.set_last_stats(holder or experts, state.stats)  # this layer's last dispatch: device tensors, no host sync
    load = installed.routing_load(holder or experts)  # plan routing: counts kept for the step
    if load is not None:
        load.record(state.stats.tokens_per_expert, state.stats.dropped_per_expert, state.stats.bytes_sent,
                    state.num_tokens, (holder or experts).training, state.stats.rank_rows)
    exchange, link, k = state.exchange, state.link, state.top_k
    hidden_size, compute, fill = state.hidden_shape[-1], state.options.compute, state.weight_grads
    combines = []
    for chunk in chunks:
        x, held = exchange.expert_rows(chunk, k, width, hidden_size)
        # with runtime.balance: this rank's experts' rows, then its guests' (the holder's call lends)
        batch = LocalBatch(x, chunk.local_counts, chunk.offsets, compute, fill, fp8_gemm=state.options.fp8_gemm,
                           lending=lending)
        y = _run_experts(experts, batch, via_call)
        y = exchange.returned_rows(chunk, y, held, k, state.weights.dtype)
        combines.append(comm.exchange(y, chunk.send_splits, chunk.recv_splits, link.group, link.overlap, link.hooks))
    outs = [
        exchange.combine(chunk, pending.wait(), state.weights[chunk.tokens], k, hidden_size)
        for chunk, pending in zip(chunks, combines, strict=True)
    ]
    for side in state.beside:  # the shared expert, run beside the exchange, is done before it is merged
        torch.get_device_module(side.device).current_stream(side.device).wait_stream(side)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if state.identity is not None:
        out = out + state.identity
    out = out.to(state.hidden_dtype)
    if state.tp_tokens is not None:  # every rank of the TP group gets back all of its tokens
        ep = state.ep
        out = tokens.gather(out, ep.tp_group, ep.tp_rank, ep.tp_size, state.tp_tokens)
    return out


def moe_forward(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, experts: nn.Module, *,
                binding: ExpertParallelBinding) -> torch.Tensor:
    """One call: dispatch, local experts, combine. Same numerics as the two-phase API."""
    return experts_and_combine(dispatch(hidden, indices, weights, binding=binding), experts)
