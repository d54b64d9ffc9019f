"""What the whole test session shares with nothing else on the machine.

torch.compile's inductor keeps compiled kernels in one directory per user (``/tmp/torchinductor_<user>``)
whose keys do not include the CPU capability: a suite run under ``ATEN_CPU_CAPABILITY=default`` beside (or
after) one under AVX2 reuses kernels built for the other and fails to compile them. Each session (and the
worlds it spawns, which inherit the environment) gets a cache of its own, removed at its end.

The worlds also inherit ``PYTHONFAULTHANDLER``: a rank that dies of a signal (SIGSEGV, SIGBUS, SIGABRT)
prints every thread's Python stack into the output the failing test shows, not only its exit code.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE = pytest.StashKey[str]()


def pytest_configure(config) -> None:
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        config.stash[_CACHE] = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hp-rewrite-inductor-")


def pytest_unconfigure(config) -> None:
    path = config.stash.get(_CACHE, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
