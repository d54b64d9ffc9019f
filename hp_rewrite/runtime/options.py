"""Typed runtime knobs. Every knob is passed in explicitly: nothing is read from the environment."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from ..kernels import COMPUTE_KINDS
from .errors import ExpertParallelError

ComputeKind = Literal["auto", "grouped", "eager", "npu", "batched"]
DropPolicy = Literal["probs", "position"]
BalanceKind = Literal["off", "auto"]

DROP_POLICIES: tuple[str, ...] = ("probs", "position")
BALANCE_KINDS: tuple[str, ...] = ("off", "auto")


@dataclass(frozen=True)
class RuntimeOptions:
    """How the routed runtime dispatches and computes.

    compute: the expert-compute backend (:mod:`hp_rewrite.kernels`): ``grouped`` uses
        ``torch.nn.functional.grouped_mm`` (``npu_grouped_matmul`` on an NPU device), ``eager`` a
        per-expert loop, ``batched`` one bmm over a weight gathered per row (transformers' ``batched_mm``), ``npu`` torch_npu's ``npu_grouped_matmul`` + ``npu_swiglu`` whenever torch_npu
        imports (falling back to ``grouped`` beyond its limits), ``auto`` npu on NPU devices, else
        grouped where the device and dtype support it, else eager.
    chunks: split the local tokens into this many chunks; chunk c's expert GEMMs overlap chunk c+1's
        all-to-all. 1 = no chunking.
    overlap: issue the dispatch all-to-all asynchronously and wait at first use, so the shared expert
        (or the previous chunk) computes while the exchange is in flight.
    capacity_factor: None = dropless. Otherwise each expert keeps at most
        ``ceil(capacity_factor * tokens * top_k / num_experts)`` slots of each source rank.
    drop_policy: which slots an expert keeps when over capacity: ``probs`` (highest routing weight)
        or ``position`` (earliest tokens). Ties go to the earlier (token, slot).
    renormalize_kept: after dropping, rescale each token's kept weights to the sum they had before.
    dedup: send each token once to each rank that owns any of its experts (with its local expert ids
        and weights) instead of once per routed slot; the owning rank sums its experts' weighted
        outputs and sends one row back. With top-k > 1 this cuts both exchanges, forward and
        backward. Off: one row per routed slot, and the weighted sum happens on the sending rank.
    defer_expert_grads: compute the experts' weight gradients (half of their backward GEMMs) while a
        backward exchange is in flight, or at the end of backward, instead of in place (see
        :mod:`.deferred`). A rank waiting for a busier one in one layer does work it would do later,
        so uneven routing costs less. Expert weight gradients then land in ``.grad`` at the end of
        ``backward()`` without autograd hooks: refused for hooked or FSDP-sharded expert weights.
        Grouped or npu compute with ``ep > 1`` and ``overlap`` only; elsewhere it does nothing.
    dequant_chunk_mb: experts kept quantised (MXFP4 / block FP8, :mod:`.quantized`) are decoded for
        their GEMMs this many MiB at a time, temporaries counted (about 8 bytes a value; at least one
        expert), forward and backward.
    fp8_gemm: experts kept as block-FP8 codes (128 x 128 blocks) multiply their codes in the forward with
        FP8 GEMMs, the rows quantised per 128 columns (DeepSeek-V3's recipe; :mod:`hp_rewrite.kernels.fp8_gemm`;
        CUDA sm90, and an fp32 emulation on CPU), instead of decoding the weights. An approximation
        (docs/checkpoints.md gives the measured error); dX still goes through the decoded weights.
        Refused for any other expert weight. Off (the default): decoded, exactly the dequantised model.
        The CUDA path has not run on a GPU yet (``tools/device_check.py`` (d) measures it).
    balance: ``auto``: in every layer and step whose busiest rank has more than ``balance_threshold`` times
        the mean rows of the EP group, the busiest ranks' hottest experts lend rows, with a transient
        copy of their weights, to the least loaded ranks, whose weight gradients return to the owner in
        backward (:mod:`hp_rewrite.runtime.balance`). Exact: the same outputs and gradients. ``off``
        (the default, as transformers): every row is computed where its expert lives.
    balance_threshold: the max/mean rows per rank above which a layer balances (>= 1).
    balance_min_rows: the fewest rows worth one expert's weights on the wire (forward) and its gradient
        (backward): smaller moves are not made. The default is the break-even on an H100 node
        (``hp-rewrite cost`` gives it for other hardware); 1 moves any row.
    balance_replicas: the most experts one rank computes for others in one layer: their weights are held
        for the backward, like activations.
    """

    compute: ComputeKind = "auto"
    chunks: int = 1
    overlap: bool = True
    capacity_factor: float | None = None
    drop_policy: DropPolicy = "probs"
    renormalize_kept: bool = False
    dedup: bool = True
    defer_expert_grads: bool = False
    dequant_chunk_mb: float = 64.0
    fp8_gemm: bool = False
    balance: BalanceKind = "off"
    balance_threshold: float = 1.1
    balance_min_rows: int = 1024
    balance_replicas: int = 2

    @property
    def dequant_chunk_bytes(self) -> int:
        return max(1, int(self.dequant_chunk_mb * 2**20))

    def __post_init__(self) -> None:
        if self.compute not in COMPUTE_KINDS:
            raise ExpertParallelError(f"compute={self.compute!r}: choose one of {', '.join(COMPUTE_KINDS)}")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ExpertParallelError(f"chunks={self.chunks!r}: must be an integer >= 1")
        if self.capacity_factor is not None and not (self.capacity_factor > 0):
            raise ExpertParallelError(
                f"capacity_factor={self.capacity_factor!r}: must be > 0, or null for dropless routing"
            )
        if self.drop_policy not in DROP_POLICIES:
            raise ExpertParallelError(
                f"drop_policy={self.drop_policy!r}: choose one of {', '.join(DROP_POLICIES)}"
            )
        if not isinstance(self.dedup, bool):
            raise ExpertParallelError(f"dedup={self.dedup!r}: must be true or false")
        if not isinstance(self.defer_expert_grads, bool):
            raise ExpertParallelError(f"defer_expert_grads={self.defer_expert_grads!r}: must be true or false")
        if not isinstance(self.fp8_gemm, bool):
            raise ExpertParallelError(f"fp8_gemm={self.fp8_gemm!r}: must be true or false")
        if self.balance not in BALANCE_KINDS:
            raise ExpertParallelError(f"balance={self.balance!r}: choose one of {', '.join(BALANCE_KINDS)}")
        if not self.balance_threshold >= 1:
            raise ExpertParallelError(f"balance_threshold={self.balance_threshold!r}: must be >= 1 (max over mean)")
        for name in ("balance_min_rows", "balance_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ExpertParallelError(f"{name}={value!r}: must be an integer >= 1")
        if not self.dequant_chunk_mb > 0:
            raise ExpertParallelError(f"dequant_chunk_mb={self.dequant_chunk_mb!r}: must be > 0")

    def as_dict(self) -> dict:
        """Plain dict, stable key order (used in artifact hashes)."""
        return asdict(self)
