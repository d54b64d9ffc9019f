"""The per-rank FLOP formulas, as plain functions of sizes (a multiply-add is 2 FLOPs).

They follow the seed (docs/cost-model.md, "Formulas") with one correction: ``tokens`` is the
number of tokens *on this rank* (``s * b / cp``), each EP rank having its own micro-batch, as in
hp-rewrite's runtime and in every EP x DP setup. An EP rank then receives ``tokens * top_k`` routed
rows when routing is balanced; the seed divided that by ``ep`` a second time, which the EP=2
FlopCounter check measured as an ``ep``-fold underestimate. Backward of every matmul here is
``2x`` its forward (input gradient + weight gradient).
"""

from __future__ import annotations

from .spec import MLPShape


def router_flops(tokens: float, hidden: int, num_experts: int) -> float:
    """Gate projection ``[T, H] x [H, E]``; replicated on every EP rank (top-k needs every score)."""
    return 2.0 * tokens * hidden * num_experts


def expert_flops(rows: float, shape: MLPShape, t_exp: int = 1) -> float:
    """``rows`` token rows through one expert MLP: ``2 * n_ffMM * rows * h * hff / t_exp``."""
    return rows * shape.flops_per_row / t_exp


def routed_flops_balanced(tokens: float, top_k: int, shape: MLPShape, t_exp: int = 1) -> float:
    """Balanced routing: every EP rank receives ``tokens * top_k`` rows (its share of every rank's slots)."""
    return expert_flops(tokens * top_k, shape, t_exp)


def routed_flops_imbalanced(
    rank_rows: list[float] | tuple[float, ...], shape: MLPShape, t_exp: int = 1
) -> float:
    """The busiest rank's rows set the pace (all ranks meet at the combine all-to-all)."""
    return expert_flops(max(max(rank_rows, default=0.0), 0.0), shape, t_exp)


def combine_flops(tokens: float, top_k: int, hidden: int) -> float:
    """The weighted sum of the k expert outputs of each token, a batched matmul ``[T,1,K] x [T,K,H]``.

    Not in the seed: hp-rewrite's runtime computes it with ``torch.bmm`` on the sending rank
    (transformers uses ``index_add_``), and FlopCounterMode counts it.
    """
    return 2.0 * tokens * top_k * hidden


def shared_flops(tokens: float, shape: MLPShape | None, gate: bool, t_exp: int = 1) -> float:
    """Shared expert(s) on every local token, not divided by ep; plus the ``Linear(H, 1)`` shared gate."""
    if shape is None:
        return 0.0
    return expert_flops(tokens, shape, t_exp) + (2.0 * tokens * shape.hidden if gate else 0.0)
