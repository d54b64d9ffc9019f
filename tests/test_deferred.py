"""The deferred expert weight gradients (runtime.defer_expert_grads) on their own, in one process:
the same gradients as autograd's grouped GEMM, jobs run only while the awaited exchange is missing,
and the cases that would lose a gradient silently are errors. The multi-rank paths (parity, AdamW
step, GradientSync, Interleaver) are in test_ep_parity.py and test_training.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_rewrite.runtime.compute.experts import LocalBatch
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.overlap.deferred import DeferredGroupedMM, WeightGradQueue, refuse_hooked

COUNTS = [3, 0, 5, 2]  # an expert without rows keeps a zero gradient


def _grouped(x, w_in_out, offsets):
    return torch._grouped_mm(x, w_in_out, offs=offsets)


@pytest.mark.parametrize("transposed", [False, True], ids=["stored-out-in", "stored-in-out"])
def test_same_gradients_as_autograd(transposed: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (4, 8, 16) if transposed else (4, 16, 8)  # [E, in, out] or [E, out, in]; grouped_mm wants 16-byte strides
    weight = nn.Parameter(torch.randn(*shape, generator=gen))
    ref_weight = nn.Parameter(weight.detach().clone())
    x = torch.randn(sum(COUNTS), 8, generator=gen, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    dy = torch.randn(sum(COUNTS), 16, generator=gen)
    offsets = LocalBatch.from_counts(x, COUNTS).offsets
    queue = WeightGradQueue()

    def w_in_out(w):
        return w if transposed else w.transpose(1, 2)

    for step in range(2):  # the second backward accumulates into the existing .grad, as autograd does
        out = DeferredGroupedMM.apply(x, w_in_out(weight).detach(), offsets, COUNTS, weight, transposed, queue)
        (out * dy).sum().backward()
        ref = _grouped(x_ref, w_in_out(ref_weight), offsets)
        (ref * dy).sum().backward()
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(weight.grad, ref_weight.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
        assert len(queue) == 0 and queue.jobs_run == step + 1  # one k-grouped job per projection, no per-expert loop
    assert torch.count_nonzero(weight.grad[1]) == 0


def test_fill_wait_runs_jobs_only_while_the_exchange_is_missing() -> None:
    queue = WeightGradQueue()
    ran: list[int] = []
    queue._jobs.extend([lambda i=i: ran.append(i) for i in range(5)])
    arrived = iter([False, False, True])
    queue.fill_wait(lambda: next(arrived))
    assert ran == [0, 1] and len(queue) == 3 and queue.jobs_run_in_waits == 2
    queue.fill_wait(lambda: True)  # already there: a busy rank does not stop for the jobs
    assert len(queue) == 3
    queue.flush()
    assert ran == [0, 1, 2, 3, 4] and len(queue) == 0 and queue.jobs_run == 5


def test_a_gradient_taken_before_its_jobs_ran_is_an_error() -> None:
    """What FSDP's post-backward would do (read .grad and free it) while a job still adds into it."""
    weight = nn.Parameter(torch.randn(4, 16, 8))
    x0 = torch.randn(sum(COUNTS), 8, requires_grad=True)
    x0.register_hook(lambda g: setattr(weight, "grad", None))  # runs after the GEMM's backward
    x = x0 * 1.0
    offsets = LocalBatch.from_counts(x, COUNTS).offsets
    queue = WeightGradQueue()
    out = DeferredGroupedMM.apply(x, weight.transpose(1, 2).detach(), offsets, COUNTS, weight, False, queue)
    with pytest.raises(ExpertParallelError, match="taken or replaced during backward"):
        out.sum().backward()
    assert len(queue) == 0  # the failed step's other jobs are dropped, not run into the next step


def test_hooked_or_create_graph_is_refused() -> None:
    weight = nn.Parameter(torch.randn(4, 16, 8))
    refuse_hooked(weight, "Experts.down_proj")  # no hooks: fine
    weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(ExpertParallelError, match="Experts.down_proj.*gradient hooks"):
        refuse_hooked(weight, "Experts.down_proj")
    plain = nn.Parameter(torch.randn(4, 16, 8))
    x = torch.randn(sum(COUNTS), 8, requires_grad=True)
    offsets = LocalBatch.from_counts(x, COUNTS).offsets
    out = DeferredGroupedMM.apply(x, plain.transpose(1, 2).detach(), offsets, COUNTS, plain, False, WeightGradQueue())
    with pytest.raises(ExpertParallelError, match="create_graph"):
        out.sum().backward(create_graph=True)


def test_a_failed_backward_does_not_stop_the_next_from_flushing() -> None:
    """A backward that raises never reaches its flush; the next backward still flushes (the failed one's
    jobs too, as autograd keeps what it accumulated before a failure, unless ``clear()`` drops them)."""
    weight = nn.Parameter(torch.randn(4, 16, 8))
    ref_weight = nn.Parameter(weight.detach().clone())
    queue = WeightGradQueue()
    x0 = torch.randn(sum(COUNTS), 8, requires_grad=True)
    offsets = LocalBatch.from_counts(x0, COUNTS).offsets

    def boom(g):
        raise RuntimeError("a failure later in backward")

    handle = x0.register_hook(boom)
    out = DeferredGroupedMM.apply(x0 * 1.0, weight.transpose(1, 2).detach(), offsets, COUNTS, weight, False, queue)
    with pytest.raises(RuntimeError, match="a failure later"):
        out.sum().backward()
    assert len(queue) == 1  # queued, never run
    handle.remove()
    dy = torch.ones(sum(COUNTS), 16)  # what out.sum() gave the failed backward
    for _ in range(2):  # the reference: the failed step's contribution (as autograd would have kept it) + this one
        (_grouped(x0.detach(), ref_weight.transpose(1, 2), offsets) * dy).sum().backward()
    out = DeferredGroupedMM.apply(x0, weight.transpose(1, 2).detach(), offsets, COUNTS, weight, False, queue)
    (out * dy).sum().backward()
    assert len(queue) == 0  # this backward flushed, its own jobs and the failed one's
    torch.testing.assert_close(weight.grad, ref_weight.grad, rtol=1e-6, atol=1e-6)
    queue._jobs.append(lambda: None)
    queue.clear()  # what to call after a failed backward to drop its jobs instead
    assert len(queue) == 0
