"""Expert weights kept in the checkpoint's MXFP4 / block-FP8 format: this rank's codes and scales, as read.

When ``from_pretrained`` is asked to keep a quantised checkpoint quantised (``Mxfp4Config(dequantize=False)``,
``FineGrainedFP8Config(dequantize=False)``, or no config where transformers itself would keep it),
:func:`kept_expert` fills each routed expert weight of an installed holder with a
:class:`~hp_rewrite.runtime.compute.quantized.QuantizedWeight` holding only this rank's experts' codes and scales
(their bytes as stored, nothing decoded); every other weight is dequantised at load as before.

* MXFP4 (gpt-oss): the stacked ``P_blocks`` / ``P_scales`` rows of the local experts.
* block FP8 (DeepSeek-V3, Kimi-K2, Qwen3-FP8): per-expert ``[out, in]`` weights and their scale grids,
  stacked over the local experts and, for a fused ``gate_up_proj``, concatenated along ``out`` (each
  part a whole number of scale blocks, so the grids concatenate too).
"""

from __future__ import annotations

import torch

from ..runtime import installed
from ..runtime.compute.quantized import QuantizedWeight
from .quantized import DequantizingReader, QuantizedCheckpointError

__all__ = ["kept_expert"]


def kept_expert(filler, unit, name: str, sl) -> QuantizedWeight | None:
    """``name`` (an expert weight, ``sl`` its :class:`ExpertSlice`) as codes and scales, or None where the
    unit does not read quantised tensors (biases, an unquantised tensor)."""
    reader: DequantizingReader = filler.reader
    dtype, want = filler.dtype_for(name), tuple(filler.meta[name].shape)
    if sl.per_row != 1:
        raise QuantizedCheckpointError(f"{name}: flat 2-D expert weights cannot be kept quantised; {_FIX}")
    path, _, attr = name.rpartition(".")
    in_first = installed.layout(filler.model.get_submodule(path)).transposed_of(attr)  # the parameter's [E, in, out]
    if unit.key is not None:
        pair = reader.pairs.get(unit.key)
        if pair is None:
            return None
        if reader.format.method != "mxfp4":
            raise QuantizedCheckpointError(f"{unit.key}: a stacked block-FP8 expert tensor cannot be kept; {_FIX}")
        blocks = _rows(reader, pair.codes, sl, filler.device)
        scales = _rows(reader, pair.scales, sl, filler.device)
        out = QuantizedWeight.mxfp4(blocks, scales, dtype, in_first=in_first)
    else:
        out = _fp8_experts(filler, unit, name, sl, dtype)
        if out is None:
            return None
        if in_first:  # per-expert FP8 weights are [out, in]: an in-first parameter would be their transpose
            raise QuantizedCheckpointError(f"{name}: the model holds it [E, in, out], its FP8 experts are stored "
                                           f"[out, in]; {_FIX}")
    if tuple(out.shape) != want:
        raise QuantizedCheckpointError(
            f"{name}: the checkpoint's {reader.format.method} codes stand for {list(out.shape)} on this rank, the "
            f"model holds {list(want)}; {_FIX}")
    return out


_FIX = "load it with dequantize=True (Mxfp4Config / FineGrainedFP8Config), which dequantises each rank's experts"


def _rows(reader: DequantizingReader, key: str, sl, device) -> torch.Tensor:
    """The local experts' rows of a stacked raw tensor, in local order."""
    parts = [reader.read_raw(key, slice(a, b)) for a, b in sl.rows]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.to(device) if device is not None else out


def _fp8_experts(filler, unit, name: str, sl, dtype) -> QuantizedWeight | None:
    """Per-expert FP8 keys merged (``MergeModulelist(0)`` [+ ``Concatenate(1)``]) into ``[E, out, in]``."""
    reader: DequantizingReader = filler.reader
    patterns = unit.converter.source_patterns
    local = filler._local(unit, name)
    firsts = [local[p][0][1] for p in patterns if local[p]]
    if not firsts or not all(k in reader.pairs for k in firsts):
        return None
    if not all(k in reader.pairs for p in patterns for _, k in local[p]):
        raise QuantizedCheckpointError(f"{name}: some of its experts' tensors are FP8 and others not; {_FIX}")
    ops = list(unit.converter.operations)
    cat_dim = getattr(ops[-1], "dim", None) if len(ops) == 2 else None
    if len(patterns) > 1 and cat_dim != 1:
        raise QuantizedCheckpointError(f"{name}: FP8 experts joined along dim {cat_dim} cannot be kept; {_FIX}")
    block = reader.format.block
    for key in firsts[:-1]:  # each concatenated part: a whole number of scale rows
        if reader.raw[key].shape[0] % block[0]:
            raise QuantizedCheckpointError(
                f"{key} has {reader.raw[key].shape[0]} rows, not a multiple of the {block[0]}-row FP8 block: its "
                f"scale grid does not concatenate with the next part's; {_FIX}")
    stacked_codes = stacked_scales = None
    for j in range(len(local[patterns[0]])):  # one expert's parts at a time, into the stacked tensors
        pieces = [reader.pairs[local[p][j][1]] for p in patterns]
        codes = torch.cat([reader.read_raw(piece.codes, slice(None)) for piece in pieces])
        scales = torch.cat([reader.read_raw(piece.scales, slice(None)) for piece in pieces])
        if stacked_codes is None:
            count = len(local[patterns[0]])
            stacked_codes = torch.empty((count, *codes.shape), dtype=codes.dtype, device=filler.device)
            stacked_scales = torch.empty((count, *scales.shape), dtype=scales.dtype, device=filler.device)
        stacked_codes[j].copy_(codes)
        stacked_scales[j].copy_(scales)
    return QuantizedWeight.fp8(stacked_codes, stacked_scales, block, dtype)
