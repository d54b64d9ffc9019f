"""Rank 0 first: the generating rank writes a shared file (the generated artifact), the others reuse it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def rank0_first(make: Callable[[], T]) -> T:
    """``make()`` on every rank, rank 0 before the others when ``torch.distributed`` is initialised.

    Rank 0 calls it (finding or writing the artifact), then meets the others at a barrier; they call
    it after the barrier and find rank 0's result on disk (no analysis, no probe). Collective: every
    rank of the default group must call it. Without a process group it is just ``make()``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return make()
    if dist.get_rank() != 0:
        dist.barrier()  # rank 0 finds or writes it first
        return make()
    try:
        result = make()
    finally:
        dist.barrier()  # release the others even when rank 0 failed: they fail on their own, not hang
    return result
