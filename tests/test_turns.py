"""The turn-taking of hp_rewrite.interleave, in one process: who runs when, errors, no-op outside."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hp_rewrite import interleave
from hp_rewrite.runtime.turns import give_turn


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
