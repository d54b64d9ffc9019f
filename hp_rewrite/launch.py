"""Run a function on N local processes joined by a real ``torch.distributed`` process group.

``run_world(n, "pkg.module:function", payload)`` spawns n processes, initialises
``torch.distributed`` (gloo on CPU by default) over a rendezvous file, calls the function with
``(rank, world, payload)`` and returns the JSON-able value each rank returned, indexed by rank. A
rank that raises, or a world that does not finish within ``timeout``, fails the call with
:class:`WorldError` carrying every rank's error.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

from .errors import UserError


def _worker(rank: int, world: int, init_file: str, target: str, payload, out_dir: str, backend: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.json"
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        module_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        result = fn(rank, world, payload)
        out.write_text(json.dumps({"ok": True, "result": result}))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        user_error = str(e) if isinstance(e, UserError) else None  # a mistake to report without a traceback
        out.write_text(json.dumps({"ok": False, "error": traceback.format_exc(), "time": time.time(),
                                   "user_error": user_error}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorldError(RuntimeError):
    """One or more ranks failed or hung; the message names the first rank that failed. ``user_error``:
    that rank's message when what it raised was a :class:`UserError` (a mistake the user can fix)."""

    def __init__(self, message: str, first_failed: int | None = None, user_error: str | None = None) -> None:
        super().__init__(message)
        self.first_failed = first_failed
        self.user_error = user_error


def _status(tmp: str, rank: int) -> dict | None:
    f = Path(tmp) / f"rank{rank}.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def _failed(tmp: str, rank: int, proc) -> bool:
    status = _status(tmp, rank)
    return (status is not None and not status["ok"]) or (not proc.is_alive() and status is None)


def _root_cause(tmp: str, procs) -> int | None:
    """The rank that failed first: one that died without a word, else the earliest error that is not
    a peer's failure echoed by the runtime (ExchangeError), else the earliest error."""
    failures = []
    for r, p in enumerate(procs):
        status = _status(tmp, r)
        if status is None and not p.is_alive() and p.exitcode not in (0, None):
            failures.append((0, 0.0, r))
        elif status is not None and not status["ok"]:
            echoed = "ExchangeError" in status["error"] or "Connection closed by peer" in status["error"]
            failures.append((2 if echoed else 1, status.get("time", 0.0), r))
    return min(failures)[2] if failures else None


def run_world(world: int, target: str, payload=None, timeout: float = 600.0, backend: str = "gloo",
              grace: float = 60.0) -> list:
    """Run ``target`` on ``world`` ranks; return their results in rank order.

    When a rank fails (raises, or dies without a result), the others get ``grace`` seconds to stop by
    themselves (their collectives fail as soon as the peer is gone, or at the group timeout) and are
    then killed, so a failure never turns into a hang; the error names the first rank that failed.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, target, payload, tmp, backend), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        start, failed_at = time.monotonic(), None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(_failed(tmp, r, p) for r, p in enumerate(procs)):
                failed_at = now
            if now - start > timeout or (failed_at is not None and now - failed_at > grace):
                break
            time.sleep(0.05)
        first_failed = _root_cause(tmp, procs)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r in range(world):
            data = _status(tmp, r)
            if data is None:
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
            elif data["ok"]:
                results.append(data["result"])
            else:
                errors.append(f"rank {r}:\n{data['error']}")
        if hung:
            why = f"after rank {first_failed} failed" if first_failed is not None else f"within {timeout}s"
            errors.append(f"ranks {hung} did not stop {why} and were killed")
        if errors:
            head = f"rank {first_failed} failed first; " if first_failed is not None else ""
            first = _status(tmp, first_failed) if first_failed is not None else None
            raise WorldError(head + "\n".join(errors), first_failed, (first or {}).get("user_error"))
        return results
