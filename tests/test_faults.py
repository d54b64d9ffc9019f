"""Faults: a rank that raises or dies mid-forward stops the world with a clear error, no hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hp_rewrite.launch import WorldError, run_world


@pytest.mark.parametrize("mode", ["raise", "die"])
def test_failed_rank_stops_the_others(mode: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(WorldError) as err:
        run_world(2, "tests.fault_cases:faulty_training",
                  {"mode": mode, "timeout_s": 20, "out_dir": str(tmp_path)}, timeout=120, grace=30)
    elapsed = time.monotonic() - t0
    message = str(err.value)
    assert err.value.first_failed == 1, message
    assert message.startswith("rank 1 failed first"), message
    assert elapsed < 60, f"took {elapsed:.0f}s"
    # rank 0 stopped by itself with the runtime's error, instead of being killed after hanging
    assert "did not stop" not in message, message
    assert "expert-parallel all-to-all failed" in message or "Connection closed" in message, message
