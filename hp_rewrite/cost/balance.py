"""When ``runtime.balance`` pays (docs/cost-model.md, "Balancing").

A lent expert's weights cross the wire once in the forward and its weight gradient once in the
backward: ``2 * P * b`` bytes for an expert of ``P`` matmul weights in ``b``-byte values. Each row it
takes over saves its owner that expert's forward and backward GEMMs, ``6 * P`` FLOPs. The copy pays
once it takes over ``b * FLOP/s / (3 * beta)`` rows (:func:`break_even_rows`), whatever the expert's
size: about 1000 on an H100 node in bf16, 8x that between nodes. A frozen expert with LoRA sends its
weights as held (kept quantised: codes and scales) and its adapter's factors, and gets back only the
factors' gradient (:class:`LentExpert`).

:func:`forecast` predicts one layer's expert time (the busiest rank's rows, plus the copies each rank
sends and receives, not overlapped: the conservative reading) with and without balancing, for a batch
whose busiest rank gets ``skew`` times the mean rows, running the runtime's own decision on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Hardware


def break_even_rows(hw: Hardware, weight_bytes: float) -> float:
    """Rows one lent expert must take over for its weights and gradient on the wire to cost no more
    than computing them at home (``weight_bytes``: bytes per weight value)."""
    return weight_bytes * hw.achieved_flops / (3 * hw.beta_Bps)


@dataclass(frozen=True)
class LentExpert:
    """What one lent expert costs on the wire and saves in FLOPs per row.

    A trained expert sends its weights (``b`` bytes a value) and gets their gradient back, ``2 P b``, and a
    row saves ``6 P`` FLOPs. A frozen one with LoRA (``A`` factor values, which PEFT hands over in the
    weight's dtype, ``f`` bytes a value) sends its weights as held (kept quantised: the codes and scales,
    ``b`` their bytes a value) and the factors, ``P b + f A``, gets back only the factors' gradient,
    ``f A``, and a row saves the forward and the input gradient, ``4 P`` (plus the factors' ``6 A``)."""

    sent_bytes: float
    returned_bytes: float
    row_flops: float

    @classmethod
    def of(cls, matmul_params: int, weight_bytes: float, lora_params: float = 0.0,
           factor_bytes: float = 2.0) -> LentExpert:
        if lora_params:
            return cls(matmul_params * weight_bytes + factor_bytes * lora_params, factor_bytes * lora_params,
                       4 * matmul_params + 6 * lora_params)
        return cls(matmul_params * weight_bytes, matmul_params * weight_bytes, 6 * matmul_params)

    def break_even_rows(self, hw: Hardware) -> float:
        """Rows it must take over for its bytes on the wire to cost no more than computing them at home."""
        return (self.sent_bytes + self.returned_bytes) * hw.achieved_flops / (self.row_flops * hw.beta_Bps)


@dataclass(frozen=True)
class BalanceForecast:
    """One layer's routed-expert time per step on the busiest rank, without and with balancing."""

    ep: int
    skew: float  # max / mean rows per rank of the batch
    balanced_skew: float  # the same after balancing
    lent: int  # expert copies made per step
    min_rows: int  # runtime.balance_min_rows used
    time_off_s: float
    time_on_s: float
    copy: LentExpert | None = None  # what one copy sends, gets back and saves a row

    @property
    def ratio(self) -> float:
        return self.time_on_s / self.time_off_s if self.time_off_s else 1.0

    @property
    def pays(self) -> bool:
        return self.lent > 0 and self.ratio < 1.0


def forecast(*, ep: int, num_experts: int, rows_per_rank: float, matmul_params: int, weight_bytes: float,
             hw: Hardware, skew: float, threshold: float = 1.1, min_rows: int | None = None,
             replicas: int = 2, lora_params: float = 0.0, factor_bytes: float = 2.0) -> BalanceForecast:
    """The busiest rank's expert time for rows ``rows_per_rank`` per rank on average (tokens x top-k),
    one rank's experts taking ``skew`` times the mean (evenly among them), experts of ``matmul_params``
    weights each held in ``weight_bytes`` a value (kept quantised: the codes' and scales'), with LoRA of
    ``lora_params`` per expert (in ``factor_bytes`` a value) on a frozen base when given
    (:class:`LentExpert`); ``min_rows`` None: the break-even rows."""
    import torch

    from ..runtime.balance.decide import moves
    from ..runtime.options import RuntimeOptions

    if ep < 2 or num_experts % ep:
        raise ValueError(f"balancing needs ep >= 2 dividing the {num_experts} experts, got ep {ep}")
    if not 1 <= skew <= ep:
        raise ValueError(f"skew {skew}: max/mean rows per rank lies in [1, ep={ep}]")
    local = num_experts // ep
    total = rows_per_rank * ep
    hot, rest = total * skew / ep, total * (1 - skew / ep)
    loads = [hot / local] * local + [rest / (num_experts - local)] * (num_experts - local)
    per_slot = torch.tensor([round(x) for x in loads], dtype=torch.int64)
    lent = LentExpert.of(matmul_params, weight_bytes, lora_params, factor_bytes)
    min_rows = min_rows if min_rows is not None else max(1, math.ceil(lent.break_even_rows(hw)))
    options = RuntimeOptions(balance="auto", balance_threshold=threshold, balance_min_rows=min_rows,
                             balance_replicas=replicas)
    moved = moves(per_slot, ep, options)
    before = per_slot.view(ep, local).sum(1)
    after = before - moved.sum(1).view(ep, local).sum(1) + moved.sum(0)
    sent, received = (moved > 0).view(ep, local, ep).sum((1, 2)), (moved > 0).sum(0)
    row_s = lent.row_flops / hw.achieved_flops
    copy_s = (lent.sent_bytes + lent.returned_bytes) / hw.beta_Bps
    time_on = max(after[r].item() * row_s + (sent[r] + received[r]).item() * copy_s for r in range(ep))
    mean = per_slot.sum().item() / ep
    return BalanceForecast(ep, before.max().item() / mean, after.max().item() / mean, int((moved > 0).sum()),
                           min_rows, before.max().item() * row_s, time_on, lent)
