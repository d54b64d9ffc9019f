"""Frozen experts kept in the format the Hub ships them (MXFP4 codes, block-FP8 weights with scales).

A :class:`QuantizedWeight` is the experts' parameter as transformers' dequantised model has it (same
name, shape and dtype, so that PEFT's ``target_parameters`` wrap it and ``named_parameters`` lists it),
but it holds only this rank's codes and scales. The local experts read it through
:func:`projection_of`: each GEMM decodes a bounded chunk of experts (``runtime.dequant_chunk_mb``),
multiplies that chunk's rows, and drops the decoded weights; the backward decodes them again for dX.
It has no weight gradient: training it is refused. LoRA on it (PEFT's ``ParamWrapper``, which adds
``scaling * lhs @ rhs`` to the parameter while its forward runs) is applied unmerged, from the factors
PEFT holds: ``x @ W + scaling * (x @ lhs) @ rhs`` per expert, so no dense copy of the experts exists.

Every other use of the tensor (printing it, an op on it) sees the dense values, decoded on the spot;
writing into it (``merge_and_unload``, an optimizer step) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_map

from ...kernels import fp8_gemm
from ...kernels.dequant import decode_fp8, decode_mxfp4
from ..errors import ExpertParallelError

__all__ = ["QuantizedProjection", "QuantizedWeight", "projection_of", "quantized_project", "stored_param"]

_aten = torch.ops.aten
CHUNK_BYTES = 64 * 2**20  # runtime.dequant_chunk_mb's default


@dataclass(frozen=True)
class _Codes:
    """What a :class:`QuantizedWeight` stores, as the checkpoint stores it.

    method: ``mxfp4`` (``codes`` uint8 ``[E, out, in/32, 16]``, ``scales`` uint8 ``[E, out, in/32]``) or
        ``fp8`` (``codes`` float8_e4m3fn ``[E, out, in]``, ``scales`` ``[E, ceil(out/b0), ceil(in/b1)]``).
    in_first: the dense parameter is ``[E, in, out]`` (gpt-oss) rather than ``[E, out, in]``.
    """

    method: str
    codes: torch.Tensor
    scales: torch.Tensor
    in_first: bool
    block: tuple[int, int] | None = None
    lazy: tuple = ()  # what PEFT's registration check added: (lhs, rhs, alpha) or (delta,); see __torch_dispatch__

    def map(self, fn) -> _Codes:
        return replace(self, codes=fn(self.codes), scales=fn(self.scales))


class QuantizedWeight(torch.Tensor):
    """A frozen ``[E, ., .]`` expert weight kept as codes and scales (module doc)."""

    @staticmethod
    def __new__(cls, stored: _Codes, shape: torch.Size, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=stored.codes.device,
                                                   requires_grad=False)

    def __init__(self, stored: _Codes, shape: torch.Size, dtype: torch.dtype) -> None:
        self.stored = stored

    @classmethod
    def mxfp4(cls, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
              in_first: bool = True) -> QuantizedWeight:
        """``P_blocks`` / ``P_scales`` (``[E, out, in/32, 16]``, ``[E, out, in/32]``) standing for the in-first
        ``P`` ``[E, in, out]`` (gpt-oss), or with ``in_first=False`` for an out-first ``[E, out, in]`` one."""
        experts, out, groups, _ = blocks.shape
        shape = (experts, groups * 32, out) if in_first else (experts, out, groups * 32)
        return cls(_Codes("mxfp4", blocks, scales, in_first), torch.Size(shape), dtype)

    @classmethod
    def fp8(cls, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
            dtype: torch.dtype) -> QuantizedWeight:
        """Block-FP8 ``[E, out, in]`` weights with their ``[E, out/b0, in/b1]`` scales, the out-first parameter."""
        return cls(_Codes("fp8", weight, scale_inv, False, tuple(block)), weight.shape, dtype)

    def with_experts(self, codes: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
        """A weight of the same kind holding other experts' ``codes`` and ``scales`` (runtime.balance:
        experts lent by another rank, their codes as stored)."""
        stored = replace(self.stored, codes=codes, scales=scales, lazy=())
        return QuantizedWeight(stored, torch.Size((codes.shape[0], *self.shape[1:])), self.dtype)

    @property
    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.stored.codes, self.stored.scales))

    def decode(self, first: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Experts ``first..stop-1`` as the dense parameter has them, in ``dtype`` (default: its own)."""
        s = self.stored
        if s.method == "mxfp4":
            values = decode_mxfp4(s.codes[first:stop], s.scales[first:stop])  # [n, out, in]
            values = values.transpose(1, 2) if s.in_first else values
        else:
            values = decode_fp8(s.codes[first:stop], s.scales[first:stop], s.block)
        values = values.to(self.dtype)  # the one rounding transformers' dequantised parameter has
        for term in s.lazy:
            if len(term) == 1:
                values = values + term[0][first:stop]
            else:
                values = torch.baddbmm(values, term[0][first:stop], term[1][first:stop], alpha=term[2])
        return values if dtype is None else values.to(dtype)

    def dense(self) -> torch.Tensor:
        return self.decode(0, self.shape[0]).contiguous()

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"QuantizedWeight({self.stored.method}, shape={list(self.shape)}, dtype={self.dtype})"

    @property
    def codes(self) -> torch.Tensor:
        return self.stored.codes

    @property
    def scales(self) -> torch.Tensor:
        return self.stored.scales

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args and isinstance(args[0], QuantizedWeight) else None
        if func in (_aten.detach.default, _aten.alias.default) and self is not None:
            return QuantizedWeight(self.stored, self.shape, self.dtype)
        if func is _aten.set_.source_Tensor and self is not None and args[1] is self:
            return self  # parametrize re-registers the parameter onto itself (PEFT's ParamWrapper, every forward)
        if func is _aten._to_copy.default and self is not None and not self.stored.lazy:
            device = kwargs.get("device") or self.device
            dtype = kwargs.get("dtype") or self.dtype
            if dtype.is_floating_point and dtype.itemsize >= 2:  # a move, or another compute dtype
                return QuantizedWeight(self.stored.map(lambda t: t.to(device)), self.shape, dtype)
        # PEFT's registration check evaluates W + scaling * lhs @ rhs (W + delta with several adapters)
        # once: kept lazy, so that nothing is decoded (the experts' forward reads PEFT's factors itself,
        # see projection_of, and refuses a dense delta)
        if func is _aten.baddbmm.default and self is not None and not self.stored.lazy \
                and kwargs.get("beta", 1) == 1:
            alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
            return QuantizedWeight(replace(self.stored, lazy=((args[1], args[2], alpha),)), self.shape, self.dtype)
        if func is _aten.add.Tensor and self is not None and not self.stored.lazy and len(args) == 2 \
                and type(args[1]) is torch.Tensor and args[1].shape == self.shape and kwargs.get("alpha", 1) == 1:
            return QuantizedWeight(replace(self.stored, lazy=((args[1],),)), self.shape, self.dtype)
        _refuse_writes(func, args, kwargs)
        if func.is_view and self is not None:  # a view would alias a decoded copy: a write into it would be lost
            raise ExpertParallelError(
                f"{func._schema.name}: a view of an expert weight kept quantised ({self.stored.method}); its values "
                "are decoded on the fly, so a view could not write back: read them with .dense() (a copy)")
        dense = tree_map(lambda t: t.dense() if isinstance(t, QuantizedWeight) else t, (args, kwargs))
        return func(*dense[0], **dense[1])


def _refuse_writes(func, args, kwargs) -> None:
    schema = func._schema
    for i, argument in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        value = next((v for v in value if isinstance(v, QuantizedWeight)), None) if isinstance(value, (list, tuple)) \
            else value  # the foreach ops of optimizers take lists
        if isinstance(value, QuantizedWeight) and argument.alias_info is not None and argument.alias_info.is_write:
            raise ExpertParallelError(
                f"{schema.name} would write into an expert weight kept quantised ({value.stored.method}): "
                "training, merging an adapter into (merge_and_unload) or editing kept-quantised experts is "
                "refused; load the model with dequantize=True for that"
            )


def stored_param(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """Parameter ``name`` of ``module`` as stored: under PEFT's parametrisation, its ``original``."""
    parametrizations = getattr(module, "parametrizations", None)
    if parametrizations is not None and name in parametrizations:
        return parametrizations[name].original
    return module._parameters.get(name)


def _factor_terms(module: torch.nn.Module, name: str) -> tuple[list, torch.nn.Module | None]:
    """The ``(lhs, rhs, scaling)`` terms PEFT's LoRA adds to parameter ``name`` of ``module`` while its
    forward runs (``W + scaling * lhs @ rhs``, each ``[E, ., .]``), in order, and the first proxy that holds
    no factors (PEFT's dense delta, with several adapters), or None."""
    parametrizations = getattr(module, "parametrizations", None)
    terms = []
    for proxy in parametrizations[name] if parametrizations is not None and name in parametrizations else ():
        lhs, rhs, scaling = (getattr(proxy, a, None) for a in ("lhs", "rhs", "scaling"))
        if lhs is None or rhs is None:
            return terms, proxy
        terms.append((lhs, rhs, float(scaling)))
    return terms, None


def lora_factors(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, list] | None:
    """Parameter ``name`` as stored and the terms PEFT's LoRA adds to it (:func:`_factor_terms`), or None:
    no LoRA on it, or one PEFT holds as a dense delta, or a kept-quantised weight (:func:`projection_of`)."""
    stored = stored_param(module, name)
    terms, dense = _factor_terms(module, name)
    if not terms or dense is not None or isinstance(stored, QuantizedWeight):
        return None
    return stored, terms


@dataclass
class QuantizedProjection:
    """A kept-quantised weight and the LoRA terms PEFT adds to it while its forward runs."""

    weight: QuantizedWeight
    terms: list[tuple[torch.Tensor, torch.Tensor, float]]  # (lhs, rhs, scaling), in the parameter's orientation
    name: str
    chunk_bytes: int = CHUNK_BYTES  # runtime.dequant_chunk_mb
    dtype: torch.dtype = None  # the compute dtype (autocast's, or the weight's)
    fp8_gemm: bool = False  # runtime.fp8_gemm: the forward multiplies the FP8 codes (kernels.fp8_gemm)

    def __post_init__(self) -> None:
        self.dtype = self.dtype or self.weight.dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def to(self, dtype: torch.dtype) -> QuantizedProjection:
        return replace(self, terms=[(a.to(dtype), b.to(dtype), s) for a, b, s in self.terms], dtype=dtype)


def projection_of(module: torch.nn.Module, name: str, owner: str,
                  chunk_bytes: int = CHUNK_BYTES, fp8: bool = False) -> QuantizedProjection | None:
    """The kept-quantised weight ``name`` of ``module`` with its active LoRA factors, or None when the
    weight is an ordinary tensor. ``fp8``: ``runtime.fp8_gemm`` (refused where it cannot run)."""
    stored = stored_param(module, name)
    where = f"{owner}.{name}"
    if fp8:
        _check_fp8_gemm(stored, where)
    if not isinstance(stored, QuantizedWeight):
        return None
    if stored.requires_grad:
        raise ExpertParallelError(
            f"{where} is kept quantised ({stored.stored.method}) and requires grad: its codes cannot be trained; "
            "freeze it (LoRA on it trains), or load the model with dequantize=True")
    terms, dense = _factor_terms(module, name)
    if dense is not None:
        raise ExpertParallelError(
            f"{where} is kept quantised and carries a {type(dense).__name__}: only one LoRA adapter at a time "
            "(PEFT's factored form) is applied to kept-quantised experts; activate one adapter, or load the "
            "model with dequantize=True")
    return QuantizedProjection(stored, terms, where, chunk_bytes, fp8_gemm=fp8)


def _check_fp8_gemm(stored: torch.Tensor | None, where: str) -> None:
    """``runtime.fp8_gemm`` multiplies block-FP8 codes: refused for any other expert weight, by name."""
    if not isinstance(stored, QuantizedWeight) or stored.stored.method != "fp8":
        held = f"kept as {stored.stored.method}" if isinstance(stored, QuantizedWeight) else "not kept as FP8 codes"
        raise ExpertParallelError(
            f"runtime.fp8_gemm: {where} is {held}; FP8 GEMMs run on experts kept as block-FP8 codes (a block-FP8 "
            "checkpoint loaded with FineGrainedFP8Config(dequantize=False)): load it so, or set runtime.fp8_gemm: "
            "false")
    why = fp8_gemm.fp8_gemm_problem(stored.device, stored.stored.block, tuple(stored.shape[1:]))
    if why:
        raise ExpertParallelError(f"runtime.fp8_gemm: {where}: {why}; set runtime.fp8_gemm: false (the experts are "
                                  "then decoded, exactly)")


class _DecodedGroupedMM(torch.autograd.Function):
    """``x_e @ W_e`` for every local expert, W decoded a chunk of experts at a time; dX the same way
    through ``W_e.T``; no weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, dtype, counts, offsets, chunk_bytes, gemm):
        ctx.weight, ctx.dtype, ctx.counts, ctx.offsets, ctx.chunk_bytes, ctx.gemm, ctx.x_dtype = (
            weight, dtype, counts, offsets, chunk_bytes, gemm, x.dtype)
        return _chunked(x, weight, dtype, counts, offsets, chunk_bytes, gemm, backward=False)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        dx = _chunked(grad.contiguous(), ctx.weight, ctx.dtype, ctx.counts, ctx.offsets, ctx.chunk_bytes,
                      ctx.gemm, backward=True)
        return dx.to(ctx.x_dtype), None, None, None, None, None, None


def _chunked(x, weight: QuantizedWeight, dtype, counts, offsets: torch.Tensor | None,
             chunk_bytes: int, gemm, backward: bool) -> torch.Tensor:
    """Rows of every expert times its decoded weight (``W_e.T`` in the backward), decoding at most
    ``chunk_bytes`` of decode temporaries (at least one expert) at a time. ``gemm(rows, w, offsets)``
    with chunk-relative device offsets; None: a matmul per expert. ``counts()`` gives the rows per
    expert as host ints: read only where the rows are cut into chunks or per expert (at EP 1 a host read)."""

    def oriented(first: int, stop: int) -> torch.Tensor:  # experts first..stop-1, [n, rows in, rows out]
        w = weight.decode(first, stop, dtype)
        w_in_out = w if weight.stored.in_first else w.transpose(1, 2)
        return w_in_out.transpose(1, 2) if backward else w_in_out

    experts = weight.shape[0]
    # the decode's temporaries: the fp32 values and about as much again (MXFP4's int32 indices and
    # gathered halves, FP8's fp32 copy of the codes), then the copy in the compute dtype
    step = max(1, chunk_bytes // max(1, weight.shape[1] * weight.shape[2] * 8))
    if step >= experts and gemm is not None and offsets is not None:  # one chunk: no host value needed
        return gemm(x.to(dtype), oriented(0, experts), offsets)
    counts = counts()
    width = weight.shape[1] if weight.stored.in_first == backward else weight.shape[2]  # the output's columns
    out = x.new_empty((x.shape[0], width), dtype=dtype)
    first_row = 0
    for first in range(0, experts, step):
        stop = min(experts, first + step)
        rows = sum(counts[first:stop])
        if rows == 0:
            continue
        w = oriented(first, stop)
        xs = x[first_row : first_row + rows].to(dtype)
        if gemm is not None and offsets is not None:
            base = offsets[first - 1] if first > 0 else 0
            out[first_row : first_row + rows] = gemm(xs, w, offsets[first:stop] - base)
        else:
            at = first_row
            for piece, we in zip(xs.split(counts[first:stop]), w.unbind(0), strict=True):
                out[at : at + piece.shape[0]] = piece @ we
                at += piece.shape[0]
        first_row += rows
    return out


class _Fp8GroupedMM(torch.autograd.Function):
    """``x_e @ W_e.T`` for every local expert with FP8 GEMMs on the stored codes (rows quantised per 128
    columns, :mod:`hp_rewrite.kernels.fp8_gemm`), one per expert with rows; dX through the decoded
    weights as :class:`_DecodedGroupedMM`'s (exact for the rows' gradient); no weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, dtype, counts, offsets, chunk_bytes, gemm):
        ctx.weight, ctx.dtype, ctx.counts, ctx.offsets, ctx.chunk_bytes, ctx.gemm, ctx.x_dtype = (
            weight, dtype, counts, offsets, chunk_bytes, gemm, x.dtype)
        stored = weight.stored
        out = x.new_empty((x.shape[0], weight.shape[1]), dtype=dtype)
        codes, scales = fp8_gemm.quantize_rows(x.to(dtype))  # every row at once
        weight_scales = fp8_gemm.weight_scales(stored.scales)  # every expert at once (small)
        at = 0
        for expert, rows in enumerate(counts()):  # host ints: the layer's one read at ep > 1
            if rows:
                out[at : at + rows] = fp8_gemm.blockwise_mm(*fp8_gemm.row_slice(codes, scales, at, at + rows),
                                                            stored.codes[expert], weight_scales[expert], dtype)
            at += rows
        return out

    backward = staticmethod(_DecodedGroupedMM.backward)


def quantized_project(projection: QuantizedProjection, x: torch.Tensor, counts,
                      offsets: torch.Tensor | None, gemm, low_rank) -> torch.Tensor:
    """``x_e @ (W_e + sum of LoRA terms)`` over the local experts' rows (module doc). ``low_rank(x, w_in_out)``
    multiplies rows by a small stacked ``[E, ., .]`` weight (the experts' own GEMM), with autograd."""
    weight = projection.weight
    product = _Fp8GroupedMM if projection.fp8_gemm else _DecodedGroupedMM
    out = product.apply(x, weight, projection.dtype, counts, offsets, projection.chunk_bytes, gemm)
    for lhs, rhs, scaling in projection.terms:
        if weight.stored.in_first:  # [E, in, out] + s * lhs [E, in, r] @ rhs [E, r, out]
            first, second = lhs, rhs
        else:  # [E, out, in]: x @ (s * lhs @ rhs).T = s * (x @ rhs.T) @ lhs.T
            first, second = rhs.transpose(1, 2), lhs.transpose(1, 2)
        first, second = first.contiguous(), second.contiguous()  # small [E, ., r] factors
        out = out + scaling * low_rank(low_rank(x.to(first.dtype), first), second)
    return out
