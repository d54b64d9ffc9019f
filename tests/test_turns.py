"""The turn-taking of hp_rewrite.interleave, in one process: who runs when, errors, no-op outside."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hp_rewrite import Interleaver, interleave
from hp_rewrite.runtime.overlap.turns import give_turn


def _steps(log: list[str], parts: dict[str, int]):
    def step(name: str, n: int):
        for i in range(n):
            log.append(f"{name}{i}")
            give_turn()  # where the runtime would wait for an exchange
        return name

    return [lambda name=name, n=n: step(name, n) for name, n in parts.items()]


def test_steps_take_turns_at_every_wait() -> None:
    log: list[str] = []
    assert interleave(_steps(log, {"a": 3, "b": 3})) == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_finished_step_is_skipped() -> None:
    log: list[str] = []
    interleave(_steps(log, {"a": 1, "b": 3, "c": 2}))
    assert log == ["a0", "b0", "c0", "b1", "c1", "b2"]


def test_only_one_step_runs_at_a_time() -> None:
    running, overlaps = [0], []
    lock = threading.Lock()

    def step():
        for _ in range(50):
            with lock:
                running[0] += 1
                overlaps.append(running[0])
            time.sleep(0.0005)  # releases the GIL: a step running concurrently would get in here
            with lock:
                running[0] -= 1
            give_turn()

    interleave([step, step, step])
    assert max(overlaps) == 1


def test_first_error_is_raised_after_every_step_ran() -> None:
    log: list[str] = []
    ok, = _steps(log, {"a": 3})

    def bad():
        log.append("bad")
        give_turn()
        raise ValueError("micro-batch 1 failed")

    with pytest.raises(ValueError, match="micro-batch 1 failed"):
        interleave([ok, bad])
    assert log == ["a0", "bad", "a1", "a2"]  # the healthy step still ran to the end


def test_grad_mode_is_carried_into_the_steps() -> None:
    with torch.no_grad():
        assert interleave([torch.is_grad_enabled, torch.is_grad_enabled]) == [False, False]
    assert interleave([torch.is_grad_enabled]) == [True]


def test_outside_interleave_give_turn_does_nothing() -> None:
    give_turn()
    assert interleave([]) == []


def test_a_kept_interleaver_reuses_its_threads_and_stops_them() -> None:
    log: list[str] = []
    seen: set[int] = set()

    def record(step):
        def wrapped():
            seen.add(threading.get_ident())
            return step()
        return wrapped

    with Interleaver() as il:
        for _ in range(3):
            assert il.run([record(s) for s in _steps(log, {"a": 2, "b": 2})]) == ["a", "b"]
        workers = [t for t in threading.enumerate() if t.name.startswith("hp-micro-batch-")]
        assert len(workers) == 1 and workers[0].ident in seen  # one worker for step a, every call
        assert seen == {workers[0].ident, threading.get_ident()}  # step b on the caller's thread
        assert il.run([]) == []
    assert not workers[0].is_alive()
    assert log == ["a0", "b0", "a1", "b1"] * 3
    with pytest.raises(RuntimeError, match="after close"):
        il.run([lambda: None])


def test_a_kept_interleaver_survives_an_error_and_grows() -> None:
    log: list[str] = []
    with Interleaver() as il:
        with pytest.raises(ValueError, match="boom"):
            il.run([lambda: (_ for _ in ()).throw(ValueError("boom")), lambda: "ok"])
        assert il.run(_steps(log, {"a": 1, "b": 2, "c": 1})) == ["a", "b", "c"]  # a third step: one more worker
    assert log == ["a0", "b0", "c0", "b1"]
