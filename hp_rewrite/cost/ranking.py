"""Rank every feasible EP degree for a world size by estimated step time, memory-checked.

Feasible: ``ep`` divides the world size and every costed layer's number of experts. Each candidate
is costed on its busiest rank (skew-aware when histograms are given: a skewed histogram loads the
rank owning the hot experts more as ``ep`` grows), timed with :mod:`timing`, and its memory per
rank (expert states shrink with ``ep``; replicated MoE states and activations do not) checked
against the device capacity minus ``reserve_bytes`` (what the rest of the model needs).
Feasible candidates come first, fastest first; infeasible ones follow with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import Hardware
from .per_rank import Knobs, ModelCost, Parallel, Precision, Workload, estimate
from .routing import Histograms
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

    @property
    def bound(self) -> str:
        """What dominates the step: ``compute`` or ``comm`` (exposed all-to-all time)."""
        return "comm" if self.time.exposed_comm > self.time.compute else "compute"


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
) -> list[Candidate]:
    """Every EP degree that fits ``world_size`` and the experts, best first."""
    if world_size < 1:
        raise ValueError(f"world size {world_size}: must be >= 1")
    base = base or Parallel()
    capacity = hw.memory_bytes - reserve_bytes
    out = []
    for ep in feasible_eps(spec, world_size):
        cost = estimate(spec, replace(base, ep=ep), work, prec, knobs, histograms)
        mem = cost.memory
        fits = mem <= capacity
        why = "" if fits else f"needs {mem / 1e9:.1f} GB/rank > {capacity / 1e9:.1f} GB"
        out.append(Candidate(ep, cost, step_time(cost, hw), mem, capacity, fits, why))
    return sorted(out, key=lambda c: (not c.feasible, c.time.total if c.feasible else c.memory_bytes, c.ep))
