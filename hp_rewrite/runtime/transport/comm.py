"""All-to-all exchange with autograd, synchronous or with the wait deferred to first use.

Works on any backend with ``all_to_all_single`` and uneven splits (gloo, nccl, hccl). The backward of
an exchange is the reverse exchange (the split sizes swap), so gradients return to the rank that sent
each row. Ranks that send or receive zero rows still take part in every collective, so the sequence of
collectives is identical on every rank.

What happens where an exchange blocks is passed in, as :class:`WaitHooks`: this module knows
neither the turn scheduler nor the gradient queue. The runtime passes the micro-batch turn hand-off
(:func:`~.turns.give_turn`, called before every blocking wait or collective, so micro-batches run by
:class:`~.turns.Interleaver` compute while another one's exchange is in flight) and, with
``runtime.defer_expert_grads``, a :class:`~.deferred.WeightGradQueue` whose jobs run while an exchange
that has not arrived yet is awaited (see :mod:`.context`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.autograd import Function


class WaitFiller(Protocol):
    """Work to do while an exchange is awaited (a :class:`~.deferred.WeightGradQueue`)."""

    def fill_wait(self, done: Callable[[], bool]) -> None: ...

    def clear(self) -> None: ...


def _stay() -> None:
    """No scheduler: keep running."""


@dataclass(frozen=True)
class WaitHooks:
    """What an exchange does where it blocks.

    turn: called right before every blocking wait or collective (the micro-batch scheduler's hand-off).
    filler: runs queued work while an exchange that has not arrived yet is awaited, and is cleared
        when a backward exchange fails (its queued work belongs to a backward that will not finish).
    """

    turn: Callable[[], None] = _stay
    filler: WaitFiller | None = None


NO_HOOKS = WaitHooks()


class ExchangeError(RuntimeError):
    """An all-to-all of the EP group failed: a peer rank stopped, raised, or timed out."""


def _peer_failure(group: dist.ProcessGroup, err: Exception) -> ExchangeError:
    ranks = dist.get_process_group_ranks(group)
    return ExchangeError(
        f"expert-parallel all-to-all failed in the EP group of ranks {ranks} (this is rank "
        f"{dist.get_rank()}): a peer stopped, raised or did not answer within the group timeout. The "
        f"first error is in the failed rank's log. Backend said: {err}"
    )


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup, async_op: bool
) -> tuple[torch.Tensor, dist.Work | None]:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    try:
        work = dist.all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=group,
            async_op=async_op,
        )
    except RuntimeError as e:
        raise _peer_failure(group, e) from e
    return out, work


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, hooks):  # type: ignore[override]
        ctx.splits = (out_splits, in_splits)
        ctx.group, ctx.hooks = group, hooks
        hooks.turn()
        out, _ = _exchange(x, out_splits, in_splits, group, async_op=False)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        ctx.hooks.turn()
        g, _ = _exchange(grad, in_splits, out_splits, ctx.group, async_op=False)
        return g, None, None, None, None


class PendingExchange:
    """An exchange in flight. ``wait()`` blocks until it is done and returns the received rows.

    Waiting is idempotent; the returned tensor carries autograd back through the reverse exchange.
    """

    def __init__(self) -> None:
        self.work: dist.Work | None = None
        self.group: dist.ProcessGroup | None = None
        self.buffer: torch.Tensor | None = None
        self.link: _BackwardLink | None = None
        self.hooks: WaitHooks = NO_HOOKS
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            assert self.buffer is not None
            if self.work is not None:
                self.hooks.turn()
            self._result = _AllToAllWait.apply(self.buffer, self)
            self.buffer = None
        return self._result


class _BackwardLink:
    """Shared by a Start/Wait pair: the reverse exchange of the backward pass, in flight.

    Wait's backward (which autograd runs first) launches the reverse exchange asynchronously;
    Start's backward waits for it. Autograd nodes created between the two in the forward pass (the
    other chunks' experts) run in between, so the backward overlaps the exchange as the forward does.
    The shared expert is queued before the layer's host read, so before Start: its backward runs after
    Start's, on its side stream on a GPU, where the wait holds back the stream, not the host. It holds no graph tensors (only the gradient in flight), so it makes no reference cycle.
    """

    def __init__(
        self, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup, hooks: WaitHooks
    ) -> None:
        self.out_splits, self.in_splits, self.group, self.hooks = out_splits, in_splits, group, hooks
        self.work: dist.Work | None = None
        self.received: torch.Tensor | None = None  # the reverse exchange's output while in flight


class _AllToAllStart(Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending):  # type: ignore[override]
        out, work = _exchange(x, out_splits, in_splits, group, async_op=True)
        pending.work, pending.group = work, group
        pending.link = ctx.link = _BackwardLink(out_splits, in_splits, group, pending.hooks)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        link = ctx.link
        link.hooks.turn()
        if link.received is None:  # Wait's backward did not run: exchange now
            received, _ = _exchange(grad, link.in_splits, link.out_splits, link.group, async_op=False)
            return received, None, None, None, None
        filler = link.hooks.filler
        if filler is not None:
            filler.fill_wait(link.work.is_completed)
        try:
            link.work.wait()
        except RuntimeError as e:
            if filler is not None:
                filler.clear()  # this backward will not finish: its queued gradients are void
            raise _peer_failure(link.group, e) from e
        received, link.work, link.received = link.received, None, None
        return received, None, None, None, None


class _AllToAllWait(Function):
    @staticmethod
    def forward(ctx, buffer, pending):  # type: ignore[override]
        if pending.work is not None:
            if pending.hooks.filler is not None:
                pending.hooks.filler.fill_wait(pending.work.is_completed)
            try:
                pending.work.wait()
            except RuntimeError as e:
                raise _peer_failure(pending.group, e) from e
            pending.work = None
        ctx.link = pending.link
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        link = ctx.link
        link.received, link.work = _exchange(grad, link.in_splits, link.out_splits, link.group, async_op=True)
        return grad, None  # unused by Start's backward, which returns the exchanged gradient


class _Ready(PendingExchange):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self._result = value


def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
    hooks: WaitHooks = NO_HOOKS,
) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` (``in_splits[r]`` rows go to rank r)."""
    if group is None:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, hooks)


def all_to_all_async(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
    hooks: WaitHooks = NO_HOOKS,
) -> PendingExchange:
    """Start a differentiable all-to-all and return at once; ``.wait()`` at first use of the result.

    ``hooks``: what to do where this exchange (or its backward) blocks."""
    if group is None:
        return _Ready(x)
    pending = PendingExchange()
    pending.hooks = hooks
    pending.buffer = _AllToAllStart.apply(x, list(out_splits), list(in_splits), group, pending)
    return pending


def exchange(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
    overlap: bool,
    hooks: WaitHooks = NO_HOOKS,
) -> PendingExchange:
    """The async exchange when ``overlap``, else the sync one wrapped as already completed."""
    if overlap:
        return all_to_all_async(x, out_splits, in_splits, group, hooks)
    return _Ready(all_to_all(x, out_splits, in_splits, group, hooks))


def exchange_counts(
    counts: torch.Tensor, group: dist.ProcessGroup | None, hooks: WaitHooks = NO_HOOKS
) -> torch.Tensor:
    """Exchange integer count rows (dim 0 = destination rank, equal splits). Not differentiable.

    Started before the turn is given away, so it completes while another micro-batch computes."""
    if group is None:
        return counts
    out = torch.empty_like(counts)
    try:
        work = dist.all_to_all_single(out, counts.contiguous(), group=group, async_op=True)
        hooks.turn()
        if hooks.filler is not None:
            hooks.filler.fill_wait(work.is_completed)
        work.wait()
    except RuntimeError as e:
        raise _peer_failure(group, e) from e
    return out


def gather_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's integer ``counts [n]`` as ``[ranks, n]``. Not differentiable; on NCCL the wait holds
    the stream, not the host."""
    if group is None:
        return counts.unsqueeze(0)
    out = counts.new_empty(dist.get_world_size(group) * counts.numel())
    try:
        dist.all_gather_single(out, counts.contiguous().view(-1), group=group)
    except RuntimeError as e:
        raise _peer_failure(group, e) from e
    return out.view(-1, *counts.shape)
