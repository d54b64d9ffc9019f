"""Quantised checkpoints as the Hub ships them, read as the plain checkpoint they dequantise to.

Two formats are read (docs/checkpoints.md), both dequantised at load as transformers does with
``dequantize=True`` (what it does on its own on a CPU):

* **MXFP4** (gpt-oss): ``P_blocks`` uint8 ``[E, out, in/32, 16]`` (two E2M1 codes a byte, low nibble
  first) and ``P_scales`` uint8 ``[E, out, in/32]`` (exponent + 127) stand for the in-first parameter
  ``P`` ``[E, in, out]``;
* **block FP8** (DeepSeek-V3 / R1, Kimi-K2, Qwen3-*-FP8): ``X.weight`` float8_e4m3fn ``[out, in]`` and
  ``X.weight_scale_inv`` fp32, one per ``weight_block_size`` block, stand for ``X.weight``.

:class:`DequantizingReader` is a :class:`~hp_rewrite.loading.checkpoint_files.Reader` whose tensor list
shows each such pair as the one tensor it stands for; reading rows of it reads only the codes and
scales of those rows, a bounded chunk at a time, and dequantises in fp32 before the one rounding to
the parameter's dtype: the values transformers' ``Mxfp4Dequantize`` / ``Fp8Dequantize`` give, bit for
bit. So the rest of the loader (renamings, per-expert merges, this rank's experts only) runs unchanged.

Every other quantisation (bitsandbytes, GPTQ, AWQ, compressed-tensors...) and keeping FP8 / MXFP4
weights quantised are refused by :func:`checkpoint_format` with the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..hf import quant_method
from .checkpoint_files import CheckpointKeyError, Reader, TensorInfo

__all__ = [
    "FP4_VALUES",
    "DequantizingReader",
    "QuantFormat",
    "QuantizedCheckpointError",
    "checkpoint_format",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "fp8_linear_weights",
    "hub_quantization_config",
    "load_note",
    "quantize_fp8",
    "quantize_mxfp4",
]

#: the E2M1 value of each 4-bit code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per scale
FP8_MAX = 448.0  # largest float8_e4m3fn
_FIX = ("dequantize it once with plain transformers (from_pretrained, then save_pretrained) and load that "
        "directory")


class QuantizedCheckpointError(CheckpointKeyError):
    """A quantised checkpoint (or a quantisation config) the expert-parallel loader cannot honour."""


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's quantisation, as read from its ``quantization_config``."""

    method: str  # "mxfp4" | "fp8"
    block: tuple[int, int] | None = None  # FP8: the weight_block_size (rows, cols)

    def describe(self) -> str:
        if self.method == "fp8":
            return f"block FP8 (e4m3, {self.block[0]}x{self.block[1]} blocks)"
        return "MXFP4 (E2M1 codes, one scale per 32 values)"


def _field(config, name: str, default=None):
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def checkpoint_format(config, where: str = "the checkpoint") -> QuantFormat | None:
    """The format of a ``quantization_config`` (a dict as ``config.json`` holds it, or transformers'
    config object); None without one. Formats that cannot be dequantised here are refused by name."""
    if config is None:
        return None
    method = quant_method(config)
    if method == "mxfp4":
        return QuantFormat("mxfp4")
    if method == "fp8":
        fmt = _field(config, "fmt", "e4m3") or "e4m3"
        block = _field(config, "weight_block_size", None)
        scheme = _field(config, "activation_scheme", "dynamic") or "dynamic"
        if fmt != "e4m3" or block is None or len(block) != 2 or scheme != "dynamic":
            raise QuantizedCheckpointError(
                f"{where} is FP8 with fmt={fmt!r}, weight_block_size={block!r}, activation_scheme={scheme!r}: "
                "only block FP8 (e4m3, a [rows, cols] weight_block_size, dynamic activations, as DeepSeek-V3, "
                f"Kimi-K2 and Qwen3-FP8 ship) is dequantised at load; {_FIX}"
            )
        return QuantFormat("fp8", (int(block[0]), int(block[1])))
    name = {"bitsandbytes": "bitsandbytes", "gptq": "GPTQ", "awq": "AWQ",
            "compressed-tensors": "compressed-tensors"}.get(method, method or "an unnamed quantisation")
    raise QuantizedCheckpointError(
        f"{where} is quantised with {name} (quantization_config.quant_method={method!r}): the expert-parallel "
        f"loader reads bf16/fp32, MXFP4 and block-FP8 checkpoints only; {_FIX}"
    )


def hub_quantization_config(method: str, block: tuple[int, int] = (128, 128)) -> dict:
    """The ``quantization_config`` the releases ship: gpt-oss's MXFP4 one, or DeepSeek-V3's block FP8."""
    if method == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def fp8_linear_weights(model: nn.Module) -> set[str]:
    """The Linear weights a block-FP8 release stores quantised (every one but the output head), by
    in-memory name; the routed experts' weights are quantised too, under their per-expert keys."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def load_note(config, where: str = "the checkpoint") -> str | None:
    """How the expert-parallel loaders read ``config``'s checkpoint, for ``describe-moe`` / ``apply``
    (None for a plain one); refuses a quantisation they cannot read."""
    fmt = checkpoint_format(getattr(config, "quantization_config", None), where)
    if fmt is None:
        return None
    return (f"{fmt.describe()}, dequantised at load to {stored_dtype(config)} (transformers' dequantize=True; "
            "pass dtype= for another): each rank reads and dequantises only its own experts' codes and scales")


def stored_dtype(config) -> str:
    """The dtype ``from_pretrained`` gives a checkpoint by default (its config's), as a name."""
    dtype = getattr(config, "dtype", None) or getattr(config.get_text_config(), "dtype", None) or torch.float32
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------------------------
# the codecs (decode: what transformers computes; encode: for tiny checkpoints)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., G, 16]`` uint8 codes and ``[..., G]`` uint8 exponents -> ``[..., G * 32]`` fp32 values,
    ``fp4 * 2 ** (scale - 127)`` (exact in fp32: rounding to the parameter dtype comes after). Built in
    place in the output: the temporaries are int32 indices and one half of it."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(*blocks.shape[:-1], 2 * blocks.shape[-1], dtype=torch.float32)
    out[..., 0::2] = lut[(blocks & 0x0F).int()]
    out[..., 1::2] = lut[(blocks >> 4).int()]
    torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1), out=out)
    return out.flatten(-2)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   first_row: int = 0) -> torch.Tensor:
    """FP8 rows ``[r, c]`` (rows ``first_row...`` of the weight) times their blocks' ``scale_inv``
    (the rows of the scale grid that cover them, ``[R, C]``) in fp32, in place in the fp32 copy. Scales
    stored as uint8 are UE8M0 exponents (``2 ** (byte - 127)``, MXFP8 checkpoints), as transformers reads them."""
    out = weight.to(torch.float32)
    scales = scale_inv.to(torch.float32)
    if scale_inv.dtype == torch.uint8:
        scales = (scales - 127.0).exp2()
    per_column = scales.repeat_interleave(block[1], dim=1)[:, : weight.shape[1]]
    top = first_row // block[0] * block[0] - first_row  # where the first scale row starts (<= 0)
    for i in range(per_column.shape[0]):
        a, b = max(0, top + i * block[0]), min(weight.shape[0], top + (i + 1) * block[0])
        if a < b:
            out[a:b].mul_(per_column[i])
    return out


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N]`` floats (N a multiple of 32) -> ``(blocks [..., N/32, 16], scales [..., N/32])``:
    per 32 values the smallest power of two that fits them in E2M1, each value its nearest code."""
    x = values.to(torch.float32).contiguous().unflatten(-1, (-1, MXFP4_GROUP))
    amax = x.abs().amax(-1).clamp_min(2.0**-126)
    exponent = (torch.ceil(torch.log2(amax / 6.0))).clamp(-127, 127).to(torch.int32)
    scaled = torch.ldexp(x, -exponent.unsqueeze(-1))
    magnitudes = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2  # nearest magnitude: the interval between midpoints
    codes = (torch.bucketize(scaled.abs(), midpoints) + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight -> ``(float8_e4m3fn weight, fp32 scale_inv [ceil(r/b0), ceil(c/b1)])``, each block
    scaled by its largest magnitude over 448."""
    w = weight.to(torch.float32)
    r, c = w.shape
    grid = (math.ceil(r / block[0]), math.ceil(c / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:r, :c] = w
    tiles = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (w / scale.repeat_interleave(block[0], 0)[:r].repeat_interleave(block[1], 1)[:, :c])
    return q.to(torch.float8_e4m3fn), scale


# ----------------------------------------------------------------------------------------------
# reading


@dataclass(frozen=True)
class _Pair:
    """What a dequantised tensor is read from."""

    codes: str  # the FP8 weight / the MXFP4 blocks
    scales: str


class DequantizingReader(Reader):
    """A :class:`Reader` over a quantised checkpoint that lists and reads every quantised tensor as
    the fp32 tensor it dequantises to (module doc); ``bytes_read`` counts the codes and scales read."""

    def __init__(self, reader: Reader, fmt: QuantFormat) -> None:
        self.__dict__.update(reader.__dict__)
        self.format = fmt
        # the fp32 values of one chunk: a quarter of the largest read, so that the temporaries of a
        # chunk (codes, fp32 values, indices) stay a few MiB and the heap does not grow by them
        self.dequant_bytes = max(1, self.chunk_bytes // 4)
        self.raw: dict[str, TensorInfo] = dict(reader.infos)
        self.pairs: dict[str, _Pair] = {}
        infos = dict(reader.infos)
        if fmt.method == "fp8":
            self._pair_fp8(infos)
        else:
            self._pair_mxfp4(infos)
        self.infos = infos

    def _pair_fp8(self, infos: dict[str, TensorInfo]) -> None:
        for key in [k for k in infos if k.endswith(".weight_scale_inv")]:
            weight = key.removesuffix("_scale_inv")
            w, s = infos.get(weight), infos.pop(key)
            if w is None or len(w.shape) != 2 or w.dtype != "F8_E4M3":
                raise QuantizedCheckpointError(
                    f"{key}: its weight {weight} is {'absent' if w is None else f'{w.dtype} {list(w.shape)}'}; "
                    "block FP8 stores a 2-D float8_e4m3fn weight beside each weight_scale_inv"
                )
            grid = tuple(math.ceil(n / b) for n, b in zip(w.shape, self.format.block, strict=True))
            if tuple(s.shape) != grid:
                raise QuantizedCheckpointError(
                    f"{key} {list(s.shape)}: {weight} {list(w.shape)} in {list(self.format.block)} blocks "
                    f"(quantization_config.weight_block_size) needs a {list(grid)} scale grid"
                )
            infos[weight] = TensorInfo(w.file, w.shape, "F32")
            self.pairs[weight] = _Pair(weight, key)
        for key in [k for k in infos if k.endswith(".activation_scale")]:
            del infos[key]  # static activation scales: unused once the weights are dequantised
        left = sorted(k for k, i in infos.items() if i.dtype == "F8_E4M3" and k not in self.pairs)
        if left:
            raise QuantizedCheckpointError(f"{left[0]} is float8_e4m3fn without a weight_scale_inv beside it")

    def _pair_mxfp4(self, infos: dict[str, TensorInfo]) -> None:
        for key in [k for k in infos if k.endswith("_blocks")]:
            base = key.removesuffix("_blocks")
            b, s = infos.pop(key), infos.pop(f"{base}_scales", None)
            if s is None or len(b.shape) != 4 or b.shape[-1] != MXFP4_GROUP // 2 or tuple(s.shape) != b.shape[:-1]:
                raise QuantizedCheckpointError(
                    f"{key} {list(b.shape)}: MXFP4 stores uint8 blocks [E, out, in/32, 16] beside "
                    f"{base}_scales [E, out, in/32] ({'absent' if s is None else list(s.shape)})"
                )
            experts, out, groups, _ = b.shape
            infos[base] = TensorInfo(b.file, (experts, groups * MXFP4_GROUP, out), "F32")
            self.pairs[base] = _Pair(key, f"{base}_scales")

    def copy_into(self, key: str, out: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        pair = self.pairs.get(key)
        if pair is None:
            return super().copy_into(key, out, start, stop)
        stop = self.infos[key].shape[0] if stop is None else stop
        if self.format.method == "fp8":
            self._copy_fp8(pair, out, start, stop)
        else:
            self._copy_mxfp4(pair, out, start, stop)

    def read_raw(self, key: str, index) -> torch.Tensor:
        """Part ``index`` of a stored tensor as the file holds it (codes, scales), counted as read."""
        info = self.raw[key]
        with self._open(info.file, framework="pt") as f:
            value = f.get_slice(key)[index]
        self._count(info, value.numel())
        return value

    def _copy_fp8(self, pair: _Pair, out: torch.Tensor, start: int, stop: int) -> None:
        cols = self.raw[pair.codes].shape[1]
        block = self.format.block[0]
        step = max(1, self.dequant_bytes // (cols * 4) // block) * block  # whole scale rows a chunk
        a = start
        while a < stop:
            b = min(stop, a // block * block + step)
            weight = self.read_raw(pair.codes, slice(a, b))
            scale = self.read_raw(pair.scales, slice(a // block, (b - 1) // block + 1))
            out[a - start : b - start].copy_(dequantize_fp8(weight, scale, self.format.block, a))
            a = b

    def _copy_mxfp4(self, pair: _Pair, out: torch.Tensor, start: int, stop: int) -> None:
        _, rows, groups, _ = self.raw[pair.codes].shape
        step = max(1, self.dequant_bytes // (groups * MXFP4_GROUP * 4))  # output rows (of one expert) a chunk
        for e in range(start, stop):
            for a in range(0, rows, step):
                b = min(rows, a + step)
                blocks = self.read_raw(pair.codes, (slice(e, e + 1), slice(a, b)))[0]
                scales = self.read_raw(pair.scales, (slice(e, e + 1), slice(a, b)))[0]
                out[e - start, :, a:b].copy_(dequantize_mxfp4(blocks, scales).T)
