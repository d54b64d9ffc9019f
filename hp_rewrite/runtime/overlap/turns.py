"""Micro-batches on one rank that take turns at the runtime's all-to-all waits.

While one micro-batch waits for its exchange (the bytes in flight, or a peer rank still computing
its experts), another one computes: its attention, its experts, its backward. This is the
two-micro-batch overlap of large MoE trainers, done without touching the model's code: each
micro-batch runs in its own thread (the last one in the caller's; :class:`Interleaver` keeps the
others between calls), and exactly one thread runs at a time. A thread hands its turn to the next
one only at fixed points of the runtime (before each blocking wait or collective), so every rank
issues its collectives in the same order and the schedule does not depend on timing.

CPU graphs run their backward on the calling thread, so the backward passes take turns too. On
CUDA, autograd runs the backward on its device thread, which has no turn to give: there the forward
passes interleave and each backward runs whole (correct, with less overlap).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import TypeVar

import torch

T = TypeVar("T")


class _Turns:
    """Whose turn it is among ``n`` micro-batch threads; finished threads are skipped."""

    def __init__(self, n: int) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.live = [True] * n

    def _pass_on(self, i: int) -> None:
        n = len(self.live)
        for step in range(1, n + 1):
            j = (i + step) % n
            if self.live[j]:
                self.turn = j
                break
        self.cond.notify_all()

    def wait_for(self, i: int) -> None:
        with self.cond:
            while self.turn != i:
                self.cond.wait()

    def switch(self, i: int) -> None:
        with self.cond:
            self._pass_on(i)
            while self.turn != i:
                self.cond.wait()

    def finish(self, i: int) -> None:
        with self.cond:
            self.live[i] = False
            self._pass_on(i)

    def wait_all_finished(self) -> None:
        with self.cond:
            while any(self.live):
                self.cond.wait()


# The turn-taking of the thread that runs a micro-batch (unset everywhere else). A context variable,
# like torch's own grad mode: Interleaver.run sets it in each thread while that thread runs a step (the
# caller's thread included, for the last step) and resets it afterwards.
_TURN: ContextVar[tuple[_Turns, int] | None] = ContextVar("hp_rewrite_turn", default=None)


def in_interleaved_step() -> bool:
    """Whether this thread runs a step of :meth:`Interleaver.run`."""
    return _TURN.get() is not None


def give_turn() -> None:
    """Let the next micro-batch run until it reaches a wait of its own (no-op outside
    :meth:`Interleaver.run`).

    Called by the runtime right before it blocks on an exchange.
    """
    current = _TURN.get()
    if current is not None:
        turns, i = current
        turns.switch(i)


class Interleaver:
    """Runs micro-batch steps that take turns at the exchanges, on worker threads kept between calls.

    Keep one for a training loop (``with Interleaver() as il: ... il.run(steps)``). The reason is the
    allocator: glibc gives each thread its own malloc arena, and a thread started afresh for every step
    page-faults again every activation it allocates (about 56 000 faults per step, 1.4x the step time on
    the CPU benchmark), while a kept thread reuses its arena's memory. :func:`interleave` is this for one
    call. Not re-entrant: call ``run`` from one thread, not from inside a step.
    """

    def __init__(self) -> None:
        self._workers: list[tuple[threading.Thread, queue.SimpleQueue]] = []
        self._closed = False

    def __enter__(self) -> Interleaver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _worker(self, i: int) -> queue.SimpleQueue:
        while len(self._workers) <= i:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            name = f"hp-micro-batch-{len(self._workers)}"
            t = threading.Thread(target=_serve, args=(jobs,), name=name, daemon=True)
            t.start()
            self._workers.append((t, jobs))
        return self._workers[i][1]

    def run(self, steps: Sequence[Callable[[], T]]) -> list[T]:
        """Run ``steps`` (one per micro-batch, e.g. forward + loss + backward) taking turns at every
        all-to-all wait of the expert-parallel runtime; return their results in order.

        Every rank of the EP group must call it with the same number of steps doing the same kind of
        work (same model, same number of MoE layers per step), as they would run the steps one after
        another. Gradients accumulate into ``.grad`` as over sequential micro-batches: synchronise them
        after the call (``sync_gradients``), not with hooks that expect one backward per step. Grad
        mode is carried into the threads; other thread-local torch state (autocast) is not: enter it
        inside the step. If a step raises, the others still run to the end (their peers expect their
        collectives) and the first error is raised here. The caller's accelerator device and current
        stream (CUDA, NPU) are set in the worker threads, which would otherwise start on device 0's
        default stream.
        """
        if self._closed:
            raise RuntimeError("Interleaver.run after close()")
        n = len(steps)
        if n == 0:
            return []
        turns = _Turns(n)
        results: list = [None] * n
        errors: list[BaseException | None] = [None] * n
        grad_enabled = torch.is_grad_enabled()
        stream = _caller_stream()

        def run(i: int) -> None:
            token = _TURN.set((turns, i))
            turns.wait_for(i)
            try:
                if stream is not None:  # a thread starts on device 0's default stream, not the caller's
                    torch.accelerator.set_device_index(stream.device_index)
                    torch.accelerator.set_stream(stream)
                with torch.set_grad_enabled(grad_enabled):
                    results[i] = steps[i]()
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller below
                errors[i] = e
            finally:
                turns.finish(i)
                _TURN.reset(token)

        for i in range(n - 1):
            self._worker(i).put(functools.partial(run, i))
        run(n - 1)  # the last step runs on the calling thread: one worker fewer
        turns.wait_all_finished()
        for e in errors:
            if e is not None:
                raise e
        return results

    def close(self) -> None:
        """Stop the worker threads (idempotent)."""
        self._closed = True
        for _, jobs in self._workers:
            jobs.put(None)
        for t, _ in self._workers:
            t.join()
        self._workers.clear()


def _caller_stream():
    """The calling thread's accelerator stream (it names its device), or None where the accelerator is
    not in use (not available, or not initialised: a CPU model on a GPU host starts no CUDA context)."""
    if not torch.accelerator.is_available():
        return None
    module = torch.get_device_module(torch.accelerator.current_accelerator())
    if not getattr(module, "is_initialized", lambda: True)():
        return None
    return torch.accelerator.current_stream()


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        job()


def interleave(steps: Sequence[Callable[[], T]]) -> list[T]:
    """:meth:`Interleaver.run` once, on threads started for this call: in a training loop keep an
    :class:`Interleaver` instead, whose threads keep their allocator memory from step to step."""
    with Interleaver() as il:
        return il.run(steps)
