"""Expert-parallel process groups and expert placement.

The world is split into EP groups of ``ep_size`` consecutive ranks. Within an EP group each rank owns
``num_experts / ep_size`` consecutive experts. Ranks with the same position in different EP groups hold
replicas of the same experts: that second dimension is data parallel for the experts (its size is
``world_size / ep_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .errors import ExpertParallelError


@dataclass(frozen=True)
class ExpertParallelGroup:
    """This rank's view of the EP topology.

    group: the EP process group (None when ``size == 1``: no communication at all).
    replica_group: ranks holding the same experts (None when there is a single replica); expert
        gradients are averaged over it, non-expert gradients over the whole world.
    """

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    replica_size: int = 1
    replica_rank: int = 0
    replica_group: dist.ProcessGroup | None = None

    @classmethod
    def single(cls) -> ExpertParallelGroup:
        """EP=1 in one process: the same routed code path, no collectives."""
        return cls()

    @property
    def is_distributed(self) -> bool:
        return self.size > 1


def build_expert_parallel_group(ep_size: int, timeout_s: float | None = None) -> ExpertParallelGroup:
    """Create the EP and replica groups over the initialised default world.

    Every rank must call this (``new_group`` is collective). Without ``torch.distributed`` initialised
    only ``ep_size == 1`` is possible. ``timeout_s`` bounds every collective of the new groups: a rank
    that stops answering makes the others fail after at most that long instead of hanging.
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ExpertParallelError(f"ep_size={ep_size!r}: must be an integer >= 1")
    if not (dist.is_available() and dist.is_initialized()):
        if ep_size != 1:
            raise ExpertParallelError(
                f"ep_size={ep_size} needs torch.distributed initialised with a world size that is a "
                "multiple of it (launch with torchrun --nproc-per-node N), or use ep_size 1"
            )
        return ExpertParallelGroup.single()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ep_size != 0:
        raise ExpertParallelError(
            f"ep_size={ep_size} does not divide the world size {world}: choose an ep_size that divides it "
            f"(e.g. {', '.join(str(d) for d in range(1, world + 1) if world % d == 0)})"
        )
    replicas = world // ep_size
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    ep_group = replica_group = None
    for r in range(replicas):  # EP groups: consecutive ranks
        ranks = list(range(r * ep_size, (r + 1) * ep_size))
        g = dist.new_group(ranks, **kwargs) if ep_size > 1 else None
        if rank in ranks:
            ep_group = g
    for p in range(ep_size):  # replica groups: same position in every EP group
        ranks = list(range(p, world, ep_size))
        g = dist.new_group(ranks, **kwargs) if replicas > 1 else None
        if rank in ranks:
            replica_group = g
    return ExpertParallelGroup(
        size=ep_size,
        rank=rank % ep_size,
        group=ep_group,
        replica_size=replicas,
        replica_rank=rank // ep_size,
        replica_group=replica_group,
    )


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts live on which EP rank: rank r owns ``[r * local, (r + 1) * local)``."""

    num_experts: int
    ep_size: int
    ep_rank: int

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ExpertParallelError(
                f"num_experts={self.num_experts}: a MoE layer needs at least one expert"
            )
        if self.num_experts % self.ep_size != 0:
            choices = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ExpertParallelError(
                f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}: "
                f"choose an ep_size among {choices}"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            raise ExpertParallelError(f"ep_rank={self.ep_rank} outside [0, {self.ep_size})")

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_local(self) -> int:
        return self.ep_rank * self.num_local

    @property
    def local_slice(self) -> slice:
        return slice(self.first_local, self.first_local + self.num_local)
