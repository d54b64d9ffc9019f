"""Expert weight gradients computed in the backward's exchange waits (``runtime.defer_expert_grads``).

Half of an expert GEMM's backward is its weight gradient ``x_e^T dy_e``, which nothing needs before
the optimizer step. With the option on, the grouped GEMM's backward returns the input gradient at
once and queues one weight-gradient job per projection: the whole ``[E, in, out]`` gradient as one
k-grouped GEMM, no per-expert loop. The queue runs jobs while a
backward exchange is still in flight (:meth:`WeightGradQueue.fill_wait`, polled between jobs, so a
rank that is not waiting does not stop to run them) and everything left at the end of backward
(autograd's ``queue_callback``).

Why: with uneven routing one rank's experts get more rows in one layer and the other rank's in the
next. In step with each other, every layer waits for its busiest rank; with the weight gradients
movable, a rank that waits in one layer does work it would otherwise do later, and the busier
rank catches up. Same numbers as autograd (fp32 up to summation order).

The contract changes in one way: expert weight gradients land in ``p.grad`` at the end of
``backward()`` without going through autograd's ``AccumulateGrad``, so gradient hooks on expert
weights (FSDP, DDP, ``register_post_accumulate_grad_hook``) would not see them, and
``torch.autograd.grad`` cannot return them. :func:`refuse_hooked` turns the hook case into an error,
and a job whose ``.grad`` was taken or replaced before it ran (as FSDP's post-backward would) raises
instead of adding into a tensor nobody reads. :class:`~.gradients.GradientSync` and
:func:`~hp_rewrite.sync.gradients.reduce_gradients` handle deferred gradients.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ExpertParallelError


class WeightGradQueue:
    """Pending expert weight-gradient jobs of one EP group's models (shared by all their MoE layers).

    Jobs are self-contained (their tensors and the gradient tensor they add into), so any backward
    pass may run any job: a micro-batch's jobs may run in another micro-batch's wait.
    """

    def __init__(self) -> None:
        self._jobs: deque[Callable[[], None]] = deque()
        self._flushing_tasks: set[int] = set()  # backward passes (graph tasks) with a flush queued
        self.jobs_run = 0  # total since creation: tests and diagnostics
        self.jobs_run_in_waits = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, jobs: list[Callable[[], None]]) -> None:
        """Queue jobs from inside a backward pass, and make that backward flush at its end (once per
        backward: a flag alone would go stale when a backward fails before its flush)."""
        self._jobs.extend(jobs)
        task = torch._C._current_graph_task_id()
        if task not in self._flushing_tasks:
            self._flushing_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._flush_task(task))

    def fill_wait(self, done: Callable[[], bool]) -> None:
        """Run jobs until ``done()`` (the awaited exchange arrived) or none are left."""
        while self._jobs and not done():
            self._run_next()
            self.jobs_run_in_waits += 1

    def flush(self) -> None:
        """Run every job left (the end of a backward pass)."""
        while self._jobs:
            self._run_next()

    def _flush_task(self, task: int) -> None:
        self._flushing_tasks.discard(task)
        self.flush()

    def _run_next(self) -> None:
        try:
            self._jobs.popleft()()
        except BaseException:
            self.clear()  # the rest belongs to the same failed backward
            raise
        self.jobs_run += 1

    def clear(self) -> None:
        """Drop pending jobs (after a failed backward: their gradients belong to a step that did not finish)."""
        self._jobs.clear()


def refuse_hooked(weight: nn.Parameter, name: str) -> None:
    """Deferred gradients bypass gradient hooks: a hooked or sharded expert weight is an error, not a
    silently missing gradient."""
    from torch.distributed.tensor import DTensor

    hooked = bool(getattr(weight, "_post_accumulate_grad_hooks", None) or getattr(weight, "_backward_hooks", None))
    if hooked or isinstance(weight, DTensor):
        what = "is a DTensor (FSDP/TP-sharded)" if isinstance(weight, DTensor) else "has gradient hooks"
        raise ExpertParallelError(
            f"runtime.defer_expert_grads: the expert weight {name!r} {what}; deferred expert gradients "
            "are written into .grad at the end of backward and would bypass them. Set "
            "runtime.defer_expert_grads: false, or synchronise gradients with hp_rewrite.sync_gradients "
            "/ GradientSync instead of hooks."
        )


def _grouped_mm():
    return getattr(F, "grouped_mm", None) or torch._grouped_mm


class DeferredGroupedMM(torch.autograd.Function):
    """``x @ w_in_out`` per expert group, whose backward queues the weight gradient.

    ``weight`` is the parameter as stored (``[E, in, out]`` when ``transposed``, else ``[E, out, in]``);
    ``w_in_out`` the ``[E, in, out]`` view the GEMM uses, detached (its gradient is the queued job's).
    """

    @staticmethod
    def forward(ctx, x, w_in_out, offsets, counts, weight, transposed, queue):  # type: ignore[override]
        ctx.save_for_backward(x, w_in_out, offsets)
        ctx.counts, ctx.weight, ctx.transposed, ctx.queue = counts, weight, transposed, queue
        return _grouped_mm()(x, w_in_out, offs=offsets)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise ExpertParallelError(
                "runtime.defer_expert_grads does not support a differentiable backward (create_graph=True); "
                "set it to false for double backward"
            )
        x, w_in_out, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _grouped_mm()(dy, w_in_out.transpose(1, 2), offs=offsets)
        if sum(ctx.counts):  # the whole [E, in, out] weight gradient as one k-grouped GEMM
            grouped_grad_sink(ctx.queue, ctx.weight, ctx.transposed)(lambda: _grouped_mm()(x.t(), dy, offs=offsets))
        elif ctx.weight.grad is None:  # no rows here: a zero gradient, as autograd gives it
            ctx.weight.grad = torch.zeros_like(ctx.weight)
        return dx, None, None, None, None, None, None


def _check_grad(weight: nn.Parameter, grad: torch.Tensor) -> None:
    if weight.grad is not grad:  # e.g. FSDP took .grad at its post-backward, before the jobs ran
        raise ExpertParallelError(
            "runtime.defer_expert_grads: an expert weight's .grad was taken or replaced during backward, "
            "before its deferred gradient was complete (FSDP or another gradient hook on the experts?). "
            "Set runtime.defer_expert_grads: false for that setup. (After a backward() that failed, drop "
            "its jobs first: model.hp_rewrite.runtime.weight_grads.clear().)"
        )


def grouped_grad_sink(
    queue: WeightGradQueue, weight: nn.Parameter, transposed: bool
) -> Callable[[Callable[[], torch.Tensor]], None]:
    """A kernel's ``defer`` hook: called in backward with the computation of the whole ``[E, in, out]``
    weight gradient (one k-grouped GEMM), it queues one job that runs it and adds it into ``.grad``."""

    def sink(compute: Callable[[], torch.Tensor]) -> None:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad = weight.grad

        def run() -> None:
            _check_grad(weight, grad)
            dw = compute()  # [E, in, out]
            grad.add_(dw if transposed else dw.transpose(1, 2))

        queue.add([run])

    return sink
