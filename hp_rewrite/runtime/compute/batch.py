"""The rows a rank's experts compute, grouped by local expert, and the padding of empty groups.

:class:`LocalBatch` carries the rows with their group offsets on the device (what grouped GEMMs take)
and, at ep > 1, the same counts as host ints (already read with the layer's split sizes).
:func:`pad_empty_groups` gives every empty group one zero row before a grouped GEMM: torch's
grouped_mm has hung in the bf16 backward of an empty group (pytorch#152668), which a rank meets
whenever some local expert receives no token (small batches, decode, large EP). At ep > 1 it is
decided from the host counts, so it costs nothing when no group is empty; at ep 1 on CUDA, where no
count is on the host, every group gets one. The padded rows' outputs are dropped and their gradients
are exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..overlap.deferred import WeightGradQueue


@dataclass
class LocalBatch:
    """Rows for this rank's experts, grouped by local expert.

    offsets: cumulative rows per local expert on the device (int32), as grouped GEMMs want them.
    known_counts: the same as host ints, where the split-size sync already brought them (ep > 1);
        None at ep 1, where the grouped GEMMs need no host value (:attr:`counts` reads them on demand).
    """

    hidden: torch.Tensor
    known_counts: list[int] | None
    offsets: torch.Tensor
    compute: str = "auto"
    weight_grads: WeightGradQueue | None = None  # runtime.defer_expert_grads: where weight gradients queue
    padded: bool = False  # made by pad_empty_groups: no group is empty (never padded twice)
    fp8_gemm: bool = False  # runtime.fp8_gemm of the call: FP8 GEMMs on experts kept as block-FP8 codes
    # runtime.balance: the layer's lending (a balance.replicas.Lending), which the holder's call resolves:
    # rows past its own experts' are its guests', computed with the weights lent to it
    lending: object | None = None

    @classmethod
    def from_counts(
        cls,
        hidden: torch.Tensor,
        counts: list[int],
        compute: str = "auto",
        weight_grads: WeightGradQueue | None = None,
    ) -> LocalBatch:
        offsets = (
            torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=hidden.device, dtype=torch.int32)
        )
        return cls(hidden, list(counts), offsets, compute, weight_grads)

    @property
    def counts(self) -> list[int]:
        """Rows per local expert as host ints: the per-expert loop and the NPU kernels take a list
        (a host sync when they were not known already)."""
        if self.known_counts is None:
            self.known_counts = torch.diff(self.offsets, prepend=self.offsets.new_zeros(1)).tolist()
        return self.known_counts

    @property
    def num_groups(self) -> int:
        return self.offsets.shape[0]

    def row_experts(self) -> torch.Tensor:
        """Local expert id of every row (only needed for per-expert biases)."""
        n = self.hidden.shape[0]
        rows = torch.arange(n, device=self.hidden.device, dtype=torch.int32)
        return torch.searchsorted(self.offsets, rows, right=True)


def pad_empty_groups(batch: LocalBatch, always: bool = False) -> tuple[LocalBatch, torch.Tensor] | None:
    """``(padded batch, positions of the real rows in it)`` when the host counts show an empty group
    among non-empty ones, else None. Without host counts (ep 1) and ``always``: one zero row after
    every group, which needs no host value. Positions and offsets are computed on the device."""
    counts = batch.known_counts
    x, offsets = batch.hidden, batch.offsets
    if batch.padded:
        return None
    if counts is None:
        if not always:
            return None
        shift = torch.arange(1, offsets.shape[0] + 1, device=x.device, dtype=torch.int32)
        pad_rows, padded_counts = offsets.shape[0], None
    elif 0 not in counts or not any(counts):
        return None
    else:
        empty = torch.diff(offsets, prepend=offsets.new_zeros(1)) == 0
        shift = empty.cumsum(0, dtype=torch.int32)  # empty groups up to each group: the pad rows before it
        pad_rows, padded_counts = counts.count(0), [max(c, 1) for c in counts]
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
    group = torch.searchsorted(offsets, rows, right=True)
    before = shift - 1 if counts is None else shift  # pad rows in front of each group's first row
    positions = (rows + before[group]).long()
    padded = x.new_zeros((x.shape[0] + pad_rows, x.shape[1])).index_copy(0, positions, x)
    return LocalBatch(padded, padded_counts, (offsets + shift).to(torch.int32), batch.compute,
                      batch.weight_grads, padded=True, fp8_gemm=batch.fp8_gemm), positions
