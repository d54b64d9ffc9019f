"""One token-exchange interface, two small implementations: one row per routed slot, or one per
(token, destination rank).

:func:`~.dispatch.dispatch` and :func:`~.dispatch.experts_and_combine` do what every exchange shares
(capacity, chunking, the count exchange and its one host sync, running the local experts, starting
the return exchange, the stats). A :class:`TokenExchange` does what differs: which rows a chunk sends
and how many per destination, how received rows become the experts' batch, and how the expert outputs
are weighted, sent back and summed per token. :func:`exchange_for` picks one per layer, once.

* :class:`PerSlotExchange`: one row per kept slot, sorted by placement slot; the receiving rank
  regroups them expert-major, and the sending rank does ``sum_k weight[t,k] * y[t,k]`` (one batched
  matmul in the promoted dtype of outputs and weights). :class:`NpuPerSlotExchange` is the same with
  its permutations on Ascend's token permute ops (``runtime.compute: npu``, or ``auto`` on an NPU).
* :class:`DedupExchange` (``runtime.dedup``, ep > 1): one row per (token, rank) with its local expert
  ids and weights packed in as extra columns; the owning rank weights and sums its experts' outputs per
  row, and the sending rank adds one partial per destination rank (see :mod:`.dedup`).

The experts see the same rows in the same order either way. Either way a layer makes one count
exchange and one all-to-all per direction (per chunk), the rows in the hidden dtype, and every sum over
a token's slots runs in a fixed order (:mod:`.rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...kernels import npu_permute
from . import comm, dedup
from . import rows as rows_mod


@dataclass
class Chunk:
    """One chunk of a layer's tokens, in flight between dispatch and combine.

    send_splits / recv_splits: rows sent to / received from each rank (host ints).
    local_counts: received rows per local expert, all sources, as host ints (None on
        :class:`OnRankExchange`'s chunk, which has no host value).
    offsets: the same as cumulative ends on the device (int32), computed there from the received count
        cells: what the grouped GEMMs take, with no host-to-device copy.
    exchanges: the dispatch exchanges in flight, one per tensor :meth:`TokenExchange.send` returned.
    route: what the layer's :class:`TokenExchange` keeps to regroup and combine this chunk (each
        exchange its own kind, defined beside it).
    """

    tokens: slice
    send_splits: list[int]
    recv_splits: list[int]
    local_counts: list[int] | None
    exchanges: list[comm.PendingExchange] = field(default_factory=list)
    route: _SlotRoute | _OnRankRoute | _DedupRoute | None = None  # set by the exchange's send
    offsets: torch.Tensor | None = None


class TokenExchange(Protocol):
    """The steps in which the per-slot and deduplicated exchanges differ."""

    def plan(self, slots: torch.Tensor, num_local: int, ep_size: int) -> Any:
        """Per chunk, before any count is known: ``slots [n,K]`` placement slots (``E`` when dropped)."""

    def count_cells(self, per_dest: torch.Tensor, plans: list) -> tuple[torch.Tensor, torch.Tensor]:
        """From ``per_dest [chunks, ep, local]`` (slots per destination expert): rows sent to each rank
        ``[chunks, ep]`` and the count cells the receivers get ``[chunks, ep, width]``."""

    def side_bytes(self, top_k: int, weights_dtype: torch.dtype, hidden_dtype: torch.dtype) -> int:
        """Bytes each dispatched row carries beside its hidden state."""

    def recv_splits(self, cells: list[list[int]], num_local: int) -> list[int]:
        """Rows received from each source rank, from its count cell."""

    def send(
        self, chunk: Chunk, plan: Any, hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
        recv_counts: torch.Tensor, top_k: int, num_local: int, ep_size: int,
    ) -> list[torch.Tensor]:
        """Keep the chunk's route and return the tensors its dispatch sends, in the order the exchanges
        start (``chunk.exchanges``). ``recv_counts [ep, width]``: the count cells received from each
        source rank, on the device."""

    def expert_rows(self, chunk: Chunk, top_k: int, num_local: int, hidden_size: int) -> tuple[torch.Tensor, Any]:
        """Wait for the chunk's exchanges; return the rows expert-major (as ``chunk.local_counts`` groups them)
        and what :meth:`returned_rows` needs."""

    def returned_rows(self, chunk: Chunk, y: torch.Tensor, held: Any, top_k: int, weights_dtype: torch.dtype
                      ) -> torch.Tensor:
        """The rows to send back, from the experts' outputs ``y`` (one per expert-major row)."""

    def combine(self, chunk: Chunk, back: torch.Tensor, weights: torch.Tensor, top_k: int, hidden_size: int
                ) -> torch.Tensor:
        """``[n, H]`` per token of the chunk, from the returned rows (``weights``: the chunk's ``[n, K]``)."""


def _received_cells(recv_counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows received in (source rank, local expert) order: each row's index and its
    (source, expert) cell, flattened source-major."""
    rows = torch.arange(total, device=recv_counts.device)
    return rows, torch.searchsorted(recv_counts.reshape(-1).cumsum(0), rows, right=True)


def _expert_major_positions(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """For rows received in (source rank, local expert) order, their position in (expert, source) order."""
    flat = recv_counts.reshape(-1)
    src_major_start = flat.cumsum(0) - flat
    em = recv_counts.t().reshape(-1)  # (expert, source) order
    em_start = (em.cumsum(0) - em).view(recv_counts.shape[1], recv_counts.shape[0]).t().reshape(-1)
    rows, cell = _received_cells(recv_counts, total)
    return em_start[cell] + rows - src_major_start[cell]


def _received_experts(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """The local expert of each row received in (source rank, local expert) order."""
    return _received_cells(recv_counts, total)[1] % recv_counts.shape[1]


@dataclass
class _SlotRoute:
    rows: torch.Tensor  # slot ids (within the chunk) in dispatch order, dropped excluded
    to_expert_major: torch.Tensor | None  # recv row -> expert-major position (None when ep == 1)
    received_expert: torch.Tensor | None = None  # NPU ops: each received row's local expert (ep > 1)


class PerSlotExchange:
    """One row per kept routed slot; the weighted sum happens on the sending rank."""

    def plan(self, slots: torch.Tensor, num_local: int, ep_size: int) -> torch.Tensor:
        return torch.sort(slots.reshape(-1), stable=True).indices

    def count_cells(self, per_dest: torch.Tensor, plans: list) -> tuple[torch.Tensor, torch.Tensor]:
        return per_dest.sum(-1), per_dest

    def side_bytes(self, top_k: int, weights_dtype: torch.dtype, hidden_dtype: torch.dtype) -> int:
        return 0

    def recv_splits(self, cells: list[list[int]], num_local: int) -> list[int]:
        return [sum(cell) for cell in cells]

    def send(self, chunk, plan, hidden, slots, weights, recv_counts, top_k, num_local, ep_size) -> list[torch.Tensor]:
        rows = plan[: sum(chunk.send_splits)]
        chunk.route = self._route(rows, recv_counts, sum(chunk.recv_splits), ep_size)
        return [_slot_rows(hidden, rows, top_k)]

    def _route(self, rows: torch.Tensor, recv_counts: torch.Tensor, received: int, ep_size: int) -> _SlotRoute:
        return _SlotRoute(rows, _expert_major_positions(recv_counts, received) if ep_size > 1 else None)

    def expert_rows(self, chunk, top_k, num_local, hidden_size):
        x = chunk.exchanges[0].wait()
        to_em = chunk.route.to_expert_major
        if to_em is not None:
            order = torch.empty_like(to_em)
            order[to_em] = torch.arange(len(order), device=order.device)
            x = x.index_select(0, order)
        return x, None

    def returned_rows(self, chunk, y, held, top_k, weights_dtype):
        to_em = chunk.route.to_expert_major
        return y if to_em is None else y.index_select(0, to_em)

    def combine(self, chunk, back, weights, top_k, hidden_size):
        rows = chunk.route.rows
        n_tok = chunk.tokens.stop - chunk.tokens.start
        n_slots = n_tok * top_k
        if len(rows) == n_slots:  # dropless: a gather back to (token, slot) order
            slots = self._unsort(back, rows)
        else:  # dropped slots stay zero
            slots = back.new_zeros((n_slots, hidden_size)).index_copy(0, rows, back)
        return _weighted_sum(slots, weights, top_k, hidden_size)

    def _unsort(self, back: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Row ``i`` of ``back`` to position ``rows[i]`` (``rows``: a permutation)."""
        inverse = torch.empty_like(rows)
        inverse[rows] = torch.arange(len(rows), device=inverse.device)
        return back.index_select(0, inverse)


def _slot_rows(hidden: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """The hidden state of each slot id ``t * K + k`` in ``slots``: its backward adds a token's K slot
    gradients in slot order (:mod:`.rows`), not by atomics."""
    token = torch.div(slots, top_k, rounding_mode="floor")
    return rows_mod.gather_rows(hidden, token, rows_mod.copy_table(slots, hidden.shape[0], top_k))


def _weighted_sum(slots: torch.Tensor, weights: torch.Tensor, top_k: int, hidden_size: int) -> torch.Tensor:
    """``sum_k weights[t,k] * slots[t*K + k]``: one batched matmul in the promoted dtype."""
    dtype = torch.promote_types(slots.dtype, weights.dtype)
    n_tok = weights.shape[0]
    weighted = torch.bmm(weights.to(dtype).unsqueeze(1), slots.to(dtype).view(n_tok, top_k, hidden_size))
    return weighted.squeeze(1)


@dataclass
class _OnRankRoute:
    order: torch.Tensor  # slot ids sorted by expert, the sentinel ones (dropped, zero experts') last
    kept: torch.Tensor | None  # [n_slots, 1] in that order: a real expert's slot (None: all are)


class OnRankExchange:
    """ep 1: every row stays on this rank, so there is no count exchange and no host value at all: the
    grouped GEMMs take their offsets on the device, and ``torch.compile(fullgraph=True)`` traces the
    layer whole. Every slot is a row, so the shapes do not depend on the routing: the sentinel slots
    (capacity drops, zero experts') sort last into the last local expert's group and their outputs
    are zeroed before the weighted sum (their gradients are exactly zero)."""

    def chunk(self, hidden: torch.Tensor, slots: torch.Tensor, per_expert: torch.Tensor, sentinels: bool) -> Chunk:
        """The layer's one chunk, its rows (expert-major) ready for the experts. ``per_expert [E]``: slots
        per expert (sentinels not counted); ``sentinels``: whether any slot may hold the sentinel id
        ``E`` (capacity, zero experts)."""
        flat = slots.reshape(-1)
        n_slots, top_k = flat.shape[0], slots.shape[1]
        order = torch.sort(flat, stable=True).indices
        ends = per_expert.cumsum(0)
        offsets = torch.cat([ends[:-1], ends.new_full((1,), n_slots)]).to(torch.int32)  # sentinels: last group
        kept = (flat.index_select(0, order) < per_expert.shape[0]).unsqueeze(1) if sentinels else None
        chunk = Chunk(slice(0, slots.shape[0]), [n_slots], [n_slots], None, route=_OnRankRoute(order, kept),
                      offsets=offsets)
        rows = _slot_rows(hidden, order, top_k)
        chunk.exchanges.append(comm.exchange(rows, [n_slots], [n_slots], None, overlap=False))  # stays here
        return chunk

    def expert_rows(self, chunk, top_k, num_local, hidden_size):
        return chunk.exchanges[0].wait(), None

    def returned_rows(self, chunk, y, held, top_k, weights_dtype):
        kept = chunk.route.kept
        return y if kept is None else torch.where(kept, y, torch.zeros_like(y))

    def combine(self, chunk, back, weights, top_k, hidden_size):
        inverse = torch.empty_like(chunk.route.order)
        inverse[chunk.route.order] = torch.arange(inverse.shape[0], device=inverse.device)
        return _weighted_sum(back.index_select(0, inverse), weights, top_k, hidden_size)


class NpuPerSlotExchange(PerSlotExchange):
    """:class:`PerSlotExchange` whose reorderings that are permutations run on Ascend's
    ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` (bit for bit the same rows and gradients;
    what stays in torch and why: :mod:`hp_rewrite.kernels.npu_permute`)."""

    def _route(self, rows, recv_counts, received, ep_size):
        return _SlotRoute(rows, None, _received_experts(recv_counts, received) if ep_size > 1 else None)

    def expert_rows(self, chunk, top_k, num_local, hidden_size):
        x = chunk.exchanges[0].wait()
        if chunk.route.received_expert is None:
            return x, None
        return npu_permute.sort_by_expert(x, chunk.route.received_expert)  # (rows, their order)

    def returned_rows(self, chunk, y, held, top_k, weights_dtype):
        return y if held is None else npu_permute.unsort(y, held)

    def _unsort(self, back, rows):
        return npu_permute.unsort(back, rows)


@dataclass
class _DedupRoute:
    sent: dedup.SentRows  # the deduplicated rows
    weights_dtype: torch.dtype  # of the routing weights packed into them


class DedupExchange:
    """One row per (token, destination rank); the owning rank weights and sums its experts' outputs."""

    def plan(self, slots: torch.Tensor, num_local: int, ep_size: int) -> dedup.DedupRows:
        return dedup.plan_rows(slots, num_local, ep_size)

    def count_cells(self, per_dest: torch.Tensor, plans: list) -> tuple[torch.Tensor, torch.Tensor]:
        # rows per destination are the tokens it gets, not the slots: one more count column
        rows_per_dest = torch.stack([p.per_rank for p in plans])  # [chunks, ep]
        return rows_per_dest, torch.cat([per_dest, rows_per_dest.unsqueeze(-1)], dim=-1)

    def side_bytes(self, top_k: int, weights_dtype: torch.dtype, hidden_dtype: torch.dtype) -> int:
        # each row carries the bytes of its weights and int16 ids, one column of the hidden dtype per byte
        return sum(rows_mod.side_columns(top_k, weights_dtype)) * hidden_dtype.itemsize

    def recv_splits(self, cells: list[list[int]], num_local: int) -> list[int]:
        return [cell[num_local] for cell in cells]

    def send(self, chunk, plan, hidden, slots, weights, recv_counts, top_k, num_local, ep_size) -> list[torch.Tensor]:
        sent = dedup.sent_rows(plan, sum(chunk.send_splits), slots, weights, num_local)
        chunk.route = _DedupRoute(sent, weights.dtype)
        send_x = rows_mod.gather_rows(hidden, sent.tokens, sent.copies)
        return [rows_mod.pack_rows(send_x, sent.weights, sent.local_ids)]  # one exchange: side values packed

    def expert_rows(self, chunk, top_k, num_local, hidden_size):
        x, weights, ids = rows_mod.unpack_rows(chunk.exchanges[0].wait(), hidden_size, chunk.route.weights_dtype,
                                               top_k)
        received = dedup.received_pairs(weights, ids, num_local, sum(chunk.local_counts))
        return rows_mod.gather_rows(x, received.rows, received.table), received

    def returned_rows(self, chunk, y, held, top_k, weights_dtype):
        return dedup.weighted_partials(y, held, weights_dtype)

    def combine(self, chunk, back, weights, top_k, hidden_size):
        dtype = torch.promote_types(back.dtype, weights.dtype)
        return dedup.sum_partials(back, chunk.route.sent, chunk.tokens.stop - chunk.tokens.start, dtype)


PER_SLOT = PerSlotExchange()
ON_RANK = OnRankExchange()
NPU_PER_SLOT = NpuPerSlotExchange()
DEDUP = DedupExchange()


def exchange_for(dedup_rows: bool, ep_size: int, npu_ops: bool = False) -> TokenExchange:
    """The exchange of a layer: deduplicated with ``runtime.dedup`` when there is more than one rank;
    per slot otherwise, its permutations on the NPU ops when ``npu_ops``
    (:func:`hp_rewrite.kernels.npu_permute.wanted`)."""
    if dedup_rows and ep_size > 1:
        return DEDUP
    return NPU_PER_SLOT if npu_ops else PER_SLOT


def permutations_used(dedup_rows: bool, ep_size: int, npu_ops: bool) -> dict:
    """Which ops reorder the layer's rows, and why (the apply report shows it)."""
    exchange = exchange_for(dedup_rows, ep_size, npu_ops)
    if exchange is NPU_PER_SLOT:
        return {"backend": "npu", "reason": "npu_moe_token_permute / npu_moe_token_unpermute regroup and un-sort the "
                                            "rows (bit for bit the torch reordering)"}
    if npu_ops:
        return {"backend": "torch", "reason": "the deduplicated exchange (runtime.dedup) has no permutation for the "
                                              "NPU ops: a row serves several experts; dedup: false uses them"}
    return {"backend": "torch", "reason": "index_select (the NPU permute ops: compute npu, or auto on an NPU)"}

