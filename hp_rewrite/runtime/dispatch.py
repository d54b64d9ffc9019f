"""The routed pipeline: dispatch -> local experts -> combine, one-call or two-phase, chunked or not.

Order of work for one MoE layer on one rank (``T`` local tokens, top-k ``K``, ``E`` experts):

1. capacity (optional): drop slots beyond each expert's capacity (same on every path);
2. per chunk: sort the ``T*K`` routed slots by the placement slot of their expert (owner rank, then
   local row; with the default placement the slot is the expert id), so rows are in (destination
   rank, expert) order;
3. count exchange: every rank learns how many rows each source sends to each of its experts, for all
   chunks at once; one host sync per layer reads all split sizes;
4. token exchange (async when ``overlap``): rows travel to the ranks that own their experts;
5. local experts: received rows are regrouped expert-major and run through grouped GEMMs;
6. reverse exchange, and on the sending rank ``sum_k weight[t,k] * y[t,k]`` (one batched matmul),
   accumulated in the promoted dtype of (outputs, weights) and cast back to the hidden dtype, like
   transformers' ``grouped_mm`` path. The weights multiply expert *outputs* on the sender, so the router gradient is
   exact.

With ``options.dedup`` (the default, ep > 1) steps 4-6 move one row per (token, destination rank)
instead of one per slot: the owning rank applies the weights and sums its experts' outputs per row,
and the sender adds one partial sum per destination rank (see :mod:`.dedup`). The experts see the
same rows in the same order either way; only the order of the weighted sum's additions differs.

Two-phase use (the shared expert overlaps the in-flight dispatch)::

    state = dispatch(x, indices, weights, num_experts=E, ep=ep, options=opts)
    shared = shared_expert(x)
    routed = experts_and_combine(state, experts)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import comm, dedup
from .capacity import apply_capacity, count_per_expert
from .experts import LocalBatch, holder_of, local_experts_forward
from .groups import ExpertParallelGroup, ExpertPlacement
from .options import RuntimeOptions


@dataclass
class DispatchStats:
    """What one layer's dispatch did. Tensors stay on the device (no extra host sync); ints are host
    values already known from the split-size sync.

    tokens_per_expert: [E] slots this rank routed to each expert (after capacity).
    dropped_per_expert: [E] slots this rank dropped for capacity (zeros when dropless).
    rows_sent / rows_received: rows this rank sent / received in the dispatch exchange (to and from
        itself included; with dedup one per (token, destination rank)); the combine exchange moves the
        same counts back.
    bytes_sent / bytes_received: the same in bytes, dispatch direction (with dedup each row also carries
        its 2k side values; the combine rows do not).
    """

    tokens_per_expert: torch.Tensor
    dropped_per_expert: torch.Tensor
    rows_sent: int = 0
    rows_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class _Chunk:
    tokens: slice
    rows: torch.Tensor  # slot ids (within the chunk) in dispatch order, dropped excluded; dedup: token ids
    send_splits: list[int]
    recv_splits: list[int]
    local_counts: list[int]  # received rows per local expert, all sources
    to_expert_major: torch.Tensor | None  # recv row -> expert-major position (None when ep == 1 or dedup)
    exchange: comm.PendingExchange | None = None
    sent: dedup.SentRows | None = None  # the deduplicated rows (dedup only)
    side_exchange: comm.PendingExchange | None = None  # dedup side tensor, when not packed with the rows


@dataclass
class RoutedDispatch:
    """Pending state between :func:`dispatch` and :func:`experts_and_combine`."""

    ep: ExpertParallelGroup
    options: RuntimeOptions
    num_tokens: int
    top_k: int
    hidden_shape: torch.Size
    hidden_dtype: torch.dtype
    weights: torch.Tensor
    chunks: list[_Chunk]
    stats: DispatchStats
    placement: ExpertPlacement
    done: bool = field(default=False)


def _chunk_bounds(num_tokens: int, chunks: int) -> list[slice]:
    base, extra = divmod(num_tokens, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append(slice(start, end))
        start = end
    return bounds


def _expert_major_positions(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """For rows received in (source rank, local expert) order, their position in (expert, source) order."""
    flat = recv_counts.reshape(-1)
    src_major_end = flat.cumsum(0)
    src_major_start = src_major_end - flat
    em = recv_counts.t().reshape(-1)  # (expert, source) order
    em_start = (em.cumsum(0) - em).view(recv_counts.shape[1], recv_counts.shape[0]).t().reshape(-1)
    rows = torch.arange(total, device=recv_counts.device)
    seg = torch.searchsorted(src_major_end, rows, right=True)
    return em_start[seg] + rows - src_major_start[seg]


def dispatch(
    hidden: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    *,
    num_experts: int | None = None,
    ep: ExpertParallelGroup | None = None,
    options: RuntimeOptions | None = None,
    placement: ExpertPlacement | None = None,
    binding=None,
) -> RoutedDispatch:
    """Start the routed exchange of ``hidden [T,H]`` by ``indices/weights [T,K]`` (global expert ids).

    ``binding``: an installed holder's :class:`~.install.ExpertParallelBinding` (``binding_of``),
    which gives the other four (what generated code passes). ``placement`` (default: consecutive
    experts per rank) must be the one the experts were sharded with.
    """
    if binding is not None:
        num_experts, ep, options, placement = binding.num_experts, binding.ep, binding.options, binding.placement
    if num_experts is None or ep is None or options is None:
        raise TypeError("dispatch needs binding=, or num_experts=, ep= and options=")
    placement = placement or ExpertPlacement(num_experts, ep.size, ep.rank)
    if (placement.num_experts, placement.ep_size) != (num_experts, ep.size):
        raise ValueError(
            f"placement of {placement.num_experts} experts over {placement.ep_size} ranks used for "
            f"num_experts={num_experts} at ep_size={ep.size}"
        )
    n_local = placement.num_local
    hidden = hidden.reshape(-1, hidden.shape[-1])
    num_tokens, top_k = indices.shape
    indices = indices.long()
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
    bounds = _chunk_bounds(num_tokens, options.chunks)
    use_dedup = options.dedup and ep.size > 1
    orders, counts, plans = [], [], []
    for b in bounds:
        flat = slots[b].reshape(-1)
        if use_dedup:
            plans.append(dedup.plan_rows(slots[b], n_local, ep.size))
        else:
            orders.append(torch.sort(flat, stable=True).indices)
        counts.append(count_per_expert(flat, num_experts))
    counts_all = torch.stack(counts)  # [chunks, E]
    per_dest = counts_all.view(len(bounds), ep.size, n_local)
    if use_dedup:  # rows per destination are the tokens it gets, not the slots: one more count column
        rows_per_dest = torch.stack([p.per_rank for p in plans])  # [chunks, ep]
        cells = torch.cat([per_dest, rows_per_dest.unsqueeze(-1)], dim=-1)
    else:
        rows_per_dest, cells = per_dest.sum(-1), per_dest
    fill = _weight_grads(ep, options)
    recv = comm.exchange_counts(cells.transpose(0, 1).contiguous(), ep.group, fill)  # [src, chunks, cell]
    # The one host sync of the layer: every split size of every chunk.
    host = torch.cat([rows_per_dest.reshape(-1), recv.reshape(-1)]).tolist()
    n_chunks, width = len(bounds), cells.shape[-1]
    send_host = host[: n_chunks * ep.size]
    recv_host = host[n_chunks * ep.size :]

    row_bytes = hidden.shape[-1] * hidden.element_size()
    per_slot = counts_all.sum(0)
    stats = DispatchStats(per_slot if slot_of is None else per_slot[slot_of[:num_experts]], dropped)
    if use_dedup:  # each row carries its weights and local ids
        row_bytes += 2 * top_k * torch.finfo(dedup.side_dtype(weights.dtype)).bits // 8
    chunks = []
    for c, b in enumerate(bounds):
        send_splits = send_host[c * ep.size : (c + 1) * ep.size]
        recv_cells = [recv_host[(s * n_chunks + c) * width : (s * n_chunks + c + 1) * width] for s in range(ep.size)]
        local_counts = [sum(cell[e] for cell in recv_cells) for e in range(n_local)]
        if use_dedup:
            recv_splits = [cell[n_local] for cell in recv_cells]
            sent = dedup.sent_rows(plans[c], sum(send_splits), slots[b], weights[b], n_local)
            chunk = _Chunk(b, sent.tokens, send_splits, recv_splits, local_counts, None, sent=sent)
            send_x = hidden[b].index_select(0, sent.tokens)
            if send_x.dtype == sent.side.dtype:  # one exchange: the side tensor as extra columns
                send_x = torch.cat([send_x, sent.side], dim=1)
            else:
                chunk.side_exchange = comm.exchange(
                    sent.side, recv_splits, send_splits, ep.group, options.overlap, fill
                )
        else:
            recv_splits = [sum(cell) for cell in recv_cells]
            rows = orders[c][: sum(send_splits)]
            to_em = None
            if ep.size > 1:
                to_em = _expert_major_positions(recv[:, c, :], sum(recv_splits))
            chunk = _Chunk(b, rows, send_splits, recv_splits, local_counts, to_em)
            send_x = hidden[b].index_select(0, torch.div(rows, top_k, rounding_mode="floor"))
        chunk.exchange = comm.exchange(send_x, recv_splits, send_splits, ep.group, options.overlap, fill)
        stats.rows_sent += sum(send_splits)
        stats.rows_received += sum(recv_splits)
        chunks.append(chunk)
    stats.bytes_sent = stats.rows_sent * row_bytes
    stats.bytes_received = stats.rows_received * row_bytes
    return RoutedDispatch(
        ep, options, num_tokens, top_k, hidden.shape, hidden.dtype, weights, chunks, stats, placement
    )


def _weight_grads(ep: ExpertParallelGroup, options: RuntimeOptions):
    """The queue expert weight gradients wait in, when ``defer_expert_grads`` can pay (exchange waits exist)."""
    return ep.weight_grads if options.defer_expert_grads and options.overlap and ep.size > 1 else None


def _run_experts(experts: nn.Module, batch: LocalBatch, via_call: bool) -> torch.Tensor:
    if via_call and holder_of(experts) is not None:
        # through __call__ (of a wrapper too): FSDP and other module hooks fire, PEFT adapters apply
        return experts(batch)
    return local_experts_forward(experts, batch, getattr(experts, "hp_layout", None))


def experts_and_combine(state: RoutedDispatch, experts: nn.Module, *, via_call: bool = True) -> torch.Tensor:
    """Run the local experts on the received rows, send results back and combine them: ``[T, H]``.

    Chunk c's experts run while chunk c+1's dispatch and chunk c-1's combine are in flight.
    """
    if state.done:
        raise RuntimeError("experts_and_combine called twice on the same dispatch state")
    holder = holder_of(experts)
    binding = holder.hp_expert_parallel if holder is not None else None
    if binding is not None and binding.placement != state.placement:
        # rows were sent to the ranks of another placement: they would meet the wrong experts
        raise ValueError(
            f"{type(experts).__name__} holds the experts {list(binding.placement.local_experts)}, but the "
            f"dispatch sent this rank the rows of {list(state.placement.local_experts)}: pass "
            "placement=experts.hp_expert_parallel.placement to dispatch"
        )
    state.done = True
    (holder or experts).hp_last_stats = state.stats  # this layer's last dispatch: device tensors, no host sync
    ep, opts = state.ep, state.options
    combines = []
    k, hidden_size = state.top_k, state.hidden_shape[-1]
    fill = _weight_grads(ep, opts)
    for chunk in state.chunks:
        x = chunk.exchange.wait()
        if chunk.sent is not None:  # dedup: one row per token, its local experts in the side tensor
            if chunk.side_exchange is None:
                x, side = x[:, :hidden_size], x[:, hidden_size:]
            else:
                side = chunk.side_exchange.wait()
            pairs = dedup.pairs_of(side, k, state.placement.num_local, sum(chunk.local_counts))
            x = x.index_select(0, torch.div(pairs, k, rounding_mode="floor"))
            y = _run_experts(experts, LocalBatch.from_counts(x, chunk.local_counts, opts.compute, fill), via_call)
            y = dedup.weighted_rows(y, pairs, side, k, state.weights.dtype)
            combines.append(comm.exchange(y, chunk.send_splits, chunk.recv_splits, ep.group, opts.overlap, fill))
            continue
        if chunk.to_expert_major is not None:
            order = torch.empty_like(chunk.to_expert_major)
            order[chunk.to_expert_major] = torch.arange(len(order), device=order.device)
            x = x.index_select(0, order)
        y = _run_experts(experts, LocalBatch.from_counts(x, chunk.local_counts, opts.compute, fill), via_call)
        if chunk.to_expert_major is not None:
            y = y.index_select(0, chunk.to_expert_major)
        combines.append(comm.exchange(y, chunk.send_splits, chunk.recv_splits, ep.group, opts.overlap, fill))
    outs = []
    for chunk, pending in zip(state.chunks, combines, strict=True):
        y_sorted = pending.wait()
        n_tok = chunk.tokens.stop - chunk.tokens.start
        if chunk.sent is not None:
            outs.append(dedup.sum_partials(y_sorted, chunk.sent, n_tok))
            continue
        n_slots = n_tok * k
        if len(chunk.rows) == n_slots:  # dropless: a gather back to (token, slot) order
            inverse = torch.empty_like(chunk.rows)
            inverse[chunk.rows] = torch.arange(n_slots, device=inverse.device)
            slots = y_sorted.index_select(0, inverse)
        else:  # dropped slots stay zero
            slots = y_sorted.new_zeros((n_slots, hidden_size)).index_copy(0, chunk.rows, y_sorted)
        w = state.weights[chunk.tokens]
        dtype = torch.promote_types(slots.dtype, w.dtype)
        weighted = torch.bmm(w.to(dtype).unsqueeze(1), slots.to(dtype).view(n_tok, k, hidden_size))
        outs.append(weighted.squeeze(1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.to(state.hidden_dtype)


def moe_forward(
    hidden: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    experts: nn.Module,
    *,
    num_experts: int,
    ep: ExpertParallelGroup,
    options: RuntimeOptions,
    placement: ExpertPlacement | None = None,
) -> torch.Tensor:
    """One call: dispatch, local experts, combine. Same numerics as the two-phase API."""
    state = dispatch(hidden, indices, weights, num_experts=num_experts, ep=ep, options=options, placement=placement)
    return experts_and_combine(state, experts)
