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
import traceback
from datetime import timedelta
from pathlib import Path


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
    except BaseException:  # noqa: BLE001 - report everything to the parent
        out.write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorldError(RuntimeError):
    """One or more ranks failed or hung; the message holds each rank's error."""


def run_world(world: int, target: str, payload=None, timeout: float = 600.0, backend: str = "gloo") -> list:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker, args=(r, world, init_file, target, payload, tmp, backend), daemon=True
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results, errors = [], []
        for r in range(world):
            f = Path(tmp) / f"rank{r}.json"
            if not f.exists():
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                continue
            data = json.loads(f.read_text())
            if data["ok"]:
                results.append(data["result"])
            else:
                errors.append(f"rank {r}:\n{data['error']}")
        if hung:
            errors.append(f"ranks {hung} did not finish within {timeout}s")
        if errors:
            raise WorldError("\n".join(errors))
        return results
