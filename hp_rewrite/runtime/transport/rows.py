"""Row gathers and per-row sums whose reductions run in a fixed order, and side values packed into rows.

A token's K routed slots come back as K rows (or as one partial sum per destination rank), and a
gather that copies one row to several places has a backward that sums those copies. torch's
``index_select`` backward is ``index_add_``: on CUDA that is atomics, so each token's contributions
are added in a run-dependent order and rounded in bf16 at each step: gradients that differ bitwise
from run to run. Here every such sum is a loop over a token's copy *positions* (slot 0, 1, ...):
``table [n, width]`` names, for each output row, the source row of each position (``len(src)`` where
there is none). Each pass is a gather with distinct indices, accumulated in the promoted dtype, so
the result does not depend on the device's scheduling and no ``[n, width, H]`` buffer is built.

Side values (routing weights, expert ids) travel as extra columns of the rows' own exchange
(:func:`pack_rows`), one column per byte holding the byte's value 0..255, which every float dtype
holds exactly: one all-to-all per direction, the rows in the hidden dtype whatever the weights'
dtype, and the values and the weights' gradients arrive bit for bit. (Reinterpreting the bytes as
bf16 would be half the columns but makes NaN patterns, which anomaly checks reject and a compiled
copy may canonicalise.)
"""

from __future__ import annotations

import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable


def copy_table(positions: torch.Tensor, num_rows: int, width: int) -> torch.Tensor:
    """``[num_rows, width]``: for each row and position, which copy it is (the number of copies for none).
    ``positions``: each copy's ``row * width + position`` (distinct)."""
    n = positions.shape[0]
    table = torch.full((num_rows * width,), n, dtype=torch.long, device=positions.device)
    table[positions] = torch.arange(n, device=positions.device)
    return table.view(num_rows, width)


def fixed_order_sum(rows: torch.Tensor, table: torch.Tensor, weights: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[r] = sum_j weights[table[r, j]] * rows[table[r, j]]``, position 0 first, in ``dtype`` (the
    promoted one by default)."""
    if dtype is None:
        dtype = rows.dtype if weights is None else torch.promote_types(rows.dtype, weights.dtype)
    n, width = table.shape
    out = rows.new_zeros((n, rows.shape[-1]), dtype=dtype)
    last = rows.shape[0] - 1
    if last < 0:
        return out
    for j in range(width):  # no padded copy of ``rows``: a missing copy reads the last row, then is zeroed
        index = table[:, j]
        term = rows.index_select(0, index.clamp(max=last)).to(dtype)
        if weights is not None:
            term = term * weights.index_select(0, index.clamp(max=last)).to(dtype).unsqueeze(1)
        out += torch.where((index <= last).unsqueeze(1), term, 0)
    return out


class _GatherRows(Function):
    @staticmethod
    def forward(ctx, src, index, table):  # type: ignore[override]
        ctx.save_for_backward(table)
        return src.index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        (table,) = ctx.saved_tensors
        return fixed_order_sum(grad, table, dtype=torch.promote_types(grad.dtype, torch.float32)).to(grad.dtype), \
            None, None


def gather_rows(src: torch.Tensor, index: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``src.index_select(0, index)`` whose backward adds each source row's copies in position order:
    ``table`` (:func:`copy_table`) lists, per source row, its copies in ``index``."""
    return _GatherRows.apply(src, index, table)


class _WeightedRowSum(Function):
    @staticmethod
    def forward(ctx, y, weights, table, row_of, dtype):  # type: ignore[override]
        ctx.save_for_backward(y, weights, row_of)
        return fixed_order_sum(y, table, weights, dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        y, weights, row_of = ctx.saved_tensors
        g = grad.index_select(0, row_of)  # each pair's row gradient: a gather, nothing summed
        grad_y = (g * weights.to(g.dtype).unsqueeze(1)).to(y.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (g * y.to(g.dtype)).sum(-1).to(weights.dtype) if ctx.needs_input_grad[1] else None
        return grad_y, grad_w, None, None, None


def weighted_row_sum(y: torch.Tensor, weights: torch.Tensor, table: torch.Tensor, row_of: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """``[R, H]`` in ``dtype``: per row the sum of its pairs' ``weights[p] * y[p]`` in position order
    (``table [R, width]``); ``row_of [P]``: each pair's row."""
    return _WeightedRowSum.apply(y, weights, table, row_of, dtype)


def _as_columns(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each byte of ``t [S, n]`` as one column of ``dtype`` holding its value 0..255 (exact in every float
    dtype): never a NaN pattern, so neither anomaly checks nor a compiled copy can alter it."""
    return t.contiguous().view(torch.uint8).to(dtype)


def _from_columns(cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_as_columns`: the bytes back, as ``dtype``."""
    raw = torch.empty(cols.shape, dtype=torch.uint8, device=cols.device).copy_(cols)  # plain strides, even [1, n]
    return raw.view(dtype)


def side_columns(k: int, weights_dtype: torch.dtype) -> tuple[int, int]:
    """How many columns ``k`` weights and ``k`` int16 ids take (one per byte)."""
    return k * weights_dtype.itemsize, k * torch.int16.itemsize


class _Pack(Function):
    @staticmethod
    def forward(ctx, x, weights, ids):  # type: ignore[override]
        ctx.hidden, ctx.weights_dtype, ctx.k = x.shape[1], weights.dtype, weights.shape[1]
        return torch.cat([x, _as_columns(weights, x.dtype), _as_columns(ids.to(torch.int16), x.dtype)], dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        h, (w_cols, _) = ctx.hidden, side_columns(ctx.k, ctx.weights_dtype)
        return grad[:, :h], _from_columns(grad[:, h : h + w_cols], ctx.weights_dtype), None


class _Unpack(Function):
    @staticmethod
    def forward(ctx, packed, hidden, weights_dtype, k):  # type: ignore[override]
        w_cols, id_cols = side_columns(k, weights_dtype)
        ctx.hidden, ctx.weights_dtype, ctx.k, ctx.id_cols = hidden, weights_dtype, k, id_cols
        ctx.rows_dtype = packed.dtype
        x = packed[:, :hidden]
        weights = _from_columns(packed[:, hidden : hidden + w_cols], weights_dtype)
        ids = _from_columns(packed[:, hidden + w_cols :], torch.int16)
        ctx.mark_non_differentiable(ids)
        return x, weights, ids

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_x, grad_w, _grad_ids):  # type: ignore[override]
        if grad_x is None:
            grad_x = torch.zeros((grad_w.shape[0], ctx.hidden), dtype=ctx.rows_dtype, device=grad_w.device)
        if grad_w is None:
            grad_w = torch.zeros((grad_x.shape[0], ctx.k), dtype=ctx.weights_dtype, device=grad_x.device)
        ids = grad_x.new_zeros((grad_x.shape[0], ctx.id_cols))
        return torch.cat([grad_x, _as_columns(grad_w.to(ctx.weights_dtype), grad_x.dtype), ids], dim=1), None, None, None


def pack_rows(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[S, H + side]`` in ``x``'s dtype: the rows, then the bytes of ``weights [S, K]`` (differentiable)
    and of ``ids [S, K]`` (as int16), one column per byte."""
    return _Pack.apply(x, weights, ids)


def unpack_rows(packed: torch.Tensor, hidden: int, weights_dtype: torch.dtype, k: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [S, H], weights [S, K], ids [S, K] int16)`` from :func:`pack_rows`' rows."""
    return _Unpack.apply(packed, hidden, weights_dtype, k)
