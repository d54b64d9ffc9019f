"""The rows a rank's experts compute, grouped by local expert, and the padding of empty groups.

:class:`LocalBatch` carries the rows with their group offsets on the device (what grouped GEMMs take)
and, at ep > 1, the same counts as host ints (already read with the layer's split sizes).
:func:`pad_empty_groups` gives every empty group one zero row before a grouped GEMM: torch's
grouped_mm has hung in the bf16 backward of an empty group (pytorch#152668), which a rank meets
whenever some local expert receives no token (small batches, decode, large EP). It is decided from
the host counts, so it costs nothing when no group is empty; the padded rows' outputs are dropped
and their gradients are exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .deferred import WeightGradQueue


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


def pad_empty_groups(batch: LocalBatch) -> tuple[LocalBatch, torch.Tensor] | None:
    """``(padded batch, positions of the real rows in it)`` when the host counts show an empty group
    among non-empty ones, else None. Positions and offsets are computed on the device."""
    counts = batch.known_counts
    if counts is None or 0 not in counts or not any(counts):
        return None
    x, offsets = batch.hidden, batch.offsets
    empty = torch.diff(offsets, prepend=offsets.new_zeros(1)) == 0
    shift = empty.cumsum(0, dtype=torch.int32)  # empty groups up to each group: the pad rows before it
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
    positions = (rows + shift[torch.searchsorted(offsets, rows, right=True)]).long()
    padded = x.new_zeros((x.shape[0] + counts.count(0), x.shape[1])).index_copy(0, positions, x)
    return LocalBatch(padded, [max(c, 1) for c in counts], (offsets + shift).to(torch.int32), batch.compute,
                      batch.weight_grads), positions
