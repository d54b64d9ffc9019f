"""Rank every feasible EP (and TP) degree for a world size by estimated throughput, memory-checked.

Feasible: ``ep`` divides the world size and every costed layer's number of experts. Each candidate
is costed on its busiest rank (skew-aware when histograms are given: a skewed histogram loads the
rank owning the hot experts more as ``ep`` grows), timed with :mod:`timing`, and its memory per
rank (expert states shrink with ``ep``; replicated MoE states and activations do not) checked
against the device capacity minus ``reserve_bytes`` (what the rest of the model needs). With
``non_expert`` the whole model's states are counted, replicated or sharded (:mod:`.sharding`), and
the data-parallel collectives' exposed time is added.
Feasible candidates come first, fastest first; infeasible ones follow with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import Hardware
from .per_rank import Knobs, ModelCost, Parallel, Precision, Workload, estimate
from .routing import Histograms
from .sharding import DataParallelCost, data_parallel_cost
from .spec import ModelSpec
from .timing import StepTime, step_time


@dataclass(frozen=True)
class Candidate:
    ep: int
    cost: ModelCost
    time: StepTime
    memory_bytes: float
    capacity_bytes: float
    feasible: bool
    reason: str = ""
    data_parallel: DataParallelCost | None = None  # whole-model states and DP traffic (--non-expert)
    tp: int = 1
    world: int = 1
    cp: int = 1

    @property
    def tokens_per_s(self) -> float:
        """The world's tokens per second: ``world / (tp x cp)`` micro-batches (a TP or context group shares
        one) per step."""
        w = self.cost.workload
        batches = self.world // (self.tp * self.cp)
        return batches * w.seq_len * w.micro_batch / self.step_s if self.step_s else float("inf")

    @property
    def dp_exposed_s(self) -> float:
        """Data-parallel collectives beyond the compute they run beside (see :mod:`.sharding`)."""
        return 0.0 if self.data_parallel is None else max(self.data_parallel.comm_s - self.time.compute, 0.0)

    @property
    def step_s(self) -> float:
        return self.time.total + self.dp_exposed_s

    @property
    def bound(self) -> str:
        """What dominates the step: ``compute`` or ``comm`` (exposed all-to-all and DP time)."""
        return "comm" if self.time.exposed_comm + self.dp_exposed_s > self.time.compute else "compute"


def feasible_eps(spec: ModelSpec, world_size: int) -> list[int]:
    experts = {lay.num_experts for lay in spec.layers}
    return [d for d in range(1, world_size + 1) if world_size % d == 0 and all(e % d == 0 for e in experts)]


def suggest(
    spec: ModelSpec,
    world_size: int,
    work: Workload,
    hw: Hardware,
    base: Parallel | None = None,
    prec: Precision | None = None,
    knobs: Knobs | None = None,
    histograms: Histograms | None = None,
    reserve_bytes: float = 0.0,
    non_expert: str | None = None,
    tp_sizes: tuple[int, ...] | None = None,
    cp_sizes: tuple[int, ...] | None = None,
) -> list[Candidate]:
    """Every (EP, TP, CP) layout that fits ``world_size`` and the experts, best first (by the world's
    tokens per second: a TP or context group shares one micro-batch).

    ``tp_sizes`` / ``cp_sizes``: the TP / context degrees to try (default: ``base.tp`` / ``base.cp`` only);
    one of ep and tp must divide the other, as the runtime requires. ``non_expert``: ``replicate`` or ``fully_shard`` costs the whole
    model's states and its data-parallel collectives (:mod:`.sharding`); None costs the MoE layers'
    states only, as before.
    """
    if world_size < 1:
        raise ValueError(f"world size {world_size}: must be >= 1")
    base = base or Parallel()
    capacity = hw.memory_bytes - reserve_bytes
    out = []
    layouts = [(tp, cp) for tp in tp_sizes or (base.tp,) for cp in cp_sizes or (base.cp,)
               if world_size % (tp * cp) == 0]
    for tp, cp in layouts:
        for ep in feasible_eps(spec, world_size):
            if max(ep, tp) % min(ep, tp):
                continue
            cost = estimate(spec, replace(base, ep=ep, tp=tp, cp=cp), work, prec, knobs, histograms)
            dp = None if non_expert is None else data_parallel_cost(cost, world_size, non_expert, hw, prec)
            mem = cost.memory if dp is None else sum(c.memory.activations for c in cost.layers) + dp.state_bytes
            fits = mem <= capacity
            why = "" if fits else f"needs {mem / 1e9:.1f} GB/rank > {capacity / 1e9:.1f} GB"
            out.append(Candidate(ep, cost, step_time(cost, hw), mem, capacity, fits, why, dp, tp, world_size, cp))
    return sorted(out, key=lambda c: (not c.feasible, -c.tokens_per_s if c.feasible else c.memory_bytes, c.ep, c.tp,
                                      c.cp))
