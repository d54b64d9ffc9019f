"""Routed rows per EP rank: balanced, or from a tokens-per-expert histogram (skew-aware).

A histogram is *global* for the EP group: per expert, the routed slots of all ``ep`` ranks'
micro-batches together (what the sum over ranks of ``DispatchStats.tokens_per_expert`` gives, or
what ``hp-rewrite profile`` records). Its shape is what matters: it is rescaled to the workload's
total ``ep * tokens * top_k`` slots, so a profile taken on 2 x 64 tokens applies to 8 x 4096. Rank
``r`` owns experts ``[r * E/ep, (r + 1) * E/ep)`` (the runtime's default placement), or the experts a
plan's balanced placement gives it, and receives the sum of their counts.

The seed's fallbacks to balanced routing are kept: no histogram, a histogram shorter than the
number of experts, ``E % ep != 0``; and one added: a histogram with no slots at all.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path


@dataclass(frozen=True)
class RankLoads:
    """Rows each EP rank receives in the dispatch (self included), and where the numbers came from."""

    rows: tuple[float, ...]
    source: str  # "histogram" | "balanced"
    reason: str = ""  # why balanced (empty when a histogram was used)

    @property
    def busiest_rank(self) -> int:
        return max(range(len(self.rows)), key=lambda r: (self.rows[r], -r))

    @property
    def busiest(self) -> float:
        return max(self.rows)

    @property
    def mean(self) -> float:
        return sum(self.rows) / len(self.rows)

    @property
    def imbalance(self) -> float:
        """Busiest rank's load over the mean load (1.0 = balanced)."""
        return self.busiest / self.mean if self.mean else 1.0


def fallback_reason(histogram, num_experts: int, ep: int) -> str:
    """Why a histogram cannot be used for this layer ("" when it can)."""
    if histogram is None:
        return "no histogram"
    if len(histogram) < num_experts:
        return f"histogram has {len(histogram)} entries, fewer than the {num_experts} experts"
    if num_experts % ep:
        return f"{num_experts} experts not divisible by ep={ep}"
    if sum(histogram[:num_experts]) <= 0:
        return "histogram has no routed slots"
    return ""


def routed_share(histogram, num_experts: int, zero_experts: int) -> float:
    """The share of routed slots that go to FFN experts, not to zero (identity) experts, which are
    computed on the sending rank: the histogram's when it counts the zero experts' ids too, else uniform."""
    if not zero_experts:
        return 1.0
    every = num_experts + zero_experts
    if histogram is not None and len(histogram) >= every and sum(histogram[:every]) > 0:
        return sum(histogram[:num_experts]) / sum(histogram[:every])
    return num_experts / every


def expert_counts(
    histogram, num_experts: int, ep: int, tokens: float, top_k: int, zero_experts: int = 0
) -> tuple[tuple[float, ...], str]:
    """Global slots per expert for the workload (``ep * tokens * top_k`` in all, less the zero experts'
    share), and a fallback reason.

    Entries beyond ``num_experts`` are ignored (as in the seed).
    """
    total = ep * tokens * top_k * routed_share(histogram, num_experts, zero_experts)
    why = fallback_reason(histogram, num_experts, ep)
    if why:
        return tuple([total / num_experts] * num_experts), why
    counts = [float(c) for c in histogram[:num_experts]]
    have = sum(counts)
    if have != total:
        counts = [c * total / have for c in counts]
    return tuple(counts), ""


def kept_counts(
    counts: tuple[float, ...], ep: int, tokens: float, top_k: int, capacity_factor: float | None
) -> tuple[float, ...]:
    """Slots kept per expert with the runtime's capacity ``ceil(cf * tokens * k / E)`` per source rank.

    Each source rank is assumed to route like the global histogram (``count / ep`` slots to each
    expert), so an expert keeps ``ep * min(count / ep, capacity)``. None = dropless.
    """
    if capacity_factor is None:
        return counts
    n = len(counts)
    cap = math.ceil(Fraction(str(capacity_factor)) * Fraction(tokens).limit_denominator() * top_k / n)
    return tuple(ep * min(c / ep, cap) for c in counts)


def rank_loads_from_counts(counts: tuple[float, ...], ep: int) -> tuple[float, ...]:
    per = len(counts) // ep
    return tuple(sum(counts[r * per : (r + 1) * per]) for r in range(ep))


def rank_loads(
    histogram,
    num_experts: int,
    ep: int,
    tokens: float,
    top_k: int,
    capacity_factor: float | None = None,
    owners: tuple[tuple[int, ...], ...] | None = None,
    zero_experts: int = 0,
) -> RankLoads:
    """Rows per EP rank for one layer, balanced when the histogram cannot be used.

    ``owners``: each rank's experts under the plan's placement (None: consecutive blocks).
    ``zero_experts``: identity experts after the routed ones; their slots are never dispatched.
    """
    counts, why = expert_counts(histogram, num_experts, ep, tokens, top_k, zero_experts)
    counts = kept_counts(counts, ep, tokens, top_k, capacity_factor)
    if why:
        return RankLoads(tuple([sum(counts) / ep] * ep), "balanced", why)
    if owners is not None:
        return RankLoads(tuple(sum(counts[e] for e in mine) for mine in owners), "histogram")
    return RankLoads(rank_loads_from_counts(counts, ep), "histogram")


@dataclass(frozen=True)
class Histograms:
    """Tokens-per-expert histograms by MoE layer path; ``default`` for layers not listed."""

    by_path: dict[str, tuple[int, ...]] = field(default_factory=dict)
    default: tuple[int, ...] | None = None

    def for_layer(self, path: str) -> tuple[int, ...] | None:
        return self.by_path.get(path, self.default)

    @classmethod
    def from_json(cls, path: Path) -> Histograms:
        """Read a profile written by ``hp-rewrite profile`` (``layers[].path/tokens_per_expert``), a
        ``{path: [counts]}`` mapping, or one flat list of counts used for every layer."""
        data = json.loads(Path(path).read_text())
        if isinstance(data, list):
            return cls(default=tuple(int(c) for c in data))
        if isinstance(data, dict) and "layers" in data:
            return cls(
                {str(lay["path"]): tuple(int(c) for c in lay["tokens_per_expert"]) for lay in data["layers"]}
            )
        if isinstance(data, dict):
            return cls({str(k): tuple(int(c) for c in v) for k, v in data.items()})
        raise ValueError(f"{path}: expected a profile JSON, a {{path: [counts]}} mapping or a list of counts")
