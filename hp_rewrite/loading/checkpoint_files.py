"""The safetensors files of a checkpoint, and how their keys map onto a model's tensors.

:class:`Reader` lists every tensor of a checkpoint (``model.safetensors`` or the shards named by
``model.safetensors.index.json``) from the headers alone, and copies row ranges (dim 0) of a tensor
into preallocated tensors through bounded memory-map views (at most ``chunk_bytes`` per copy, the
file opened afresh per chunk). :func:`map_keys` groups the checkpoint keys into load units
(:class:`LoadUnit`) with transformers' conversion mapping for the model (renamings and converters, see
:func:`hp_rewrite.hf.model_conversion_mapping`). Used by :mod:`hp_rewrite.loading.local`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from ..hf import core_model_loading
from ..runtime import installed
from ..runtime.errors import ExpertParallelError

__all__ = [
    "CHUNK_BYTES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointFileError",
    "CheckpointKeyError",
    "CheckpointShapeError",
    "ExpertSlice",
    "LoadUnit",
    "MissingCheckpointFileError",
    "Reader",
    "TensorInfo",
    "UnreadableCheckpointError",
    "expert_slices",
    "foreign_experts",
    "index_regex",
    "map_keys",
    "natural_key",
    "safetensors_files",
    "torch_dtype",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 16 * 2**20  # largest single read (copy) from a file's memory map

_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip


class CheckpointKeyError(ExpertParallelError):
    """The checkpoint does not fit the model: missing, unexpected, duplicated or mis-shaped tensors."""


class CheckpointShapeError(CheckpointKeyError, RuntimeError):
    """A checkpoint tensor of another shape than the model's: a ``RuntimeError``, as transformers raises
    for a size mismatch, so that code written against ``from_pretrained`` catches it."""


class CheckpointFileError(CheckpointKeyError, OSError):
    """A checkpoint file that is absent or unreadable: an ``OSError``, as transformers raises."""


class MissingCheckpointFileError(CheckpointFileError, FileNotFoundError):
    """A checkpoint file that the checkpoint names and the directory lacks (transformers: the same)."""


class UnreadableCheckpointError(CheckpointFileError, SafetensorError):
    """A safetensors file whose header cannot be read: also safetensors' own error, which plain
    transformers lets through for the same file."""


# ----------------------------------------------------------------------------------------------
# reading


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


class Reader:
    """Row-range reads of checkpoint tensors into preallocated tensors, through bounded mmap views."""

    def __init__(self, model_dir: Path | None, chunk_bytes: int = CHUNK_BYTES, files: list[Path] | None = None) -> None:
        """The checkpoint in ``model_dir``, or exactly the safetensors ``files`` (as transformers resolved them)."""
        from safetensors import safe_open

        self._open = safe_open
        self.chunk_bytes = chunk_bytes
        self.bytes_read = 0
        self.files_read: set[str] = set()
        self.infos: dict[str, TensorInfo] = {}
        for file in [Path(f) for f in files] if files is not None else safetensors_files(model_dir):
            for key, shape, dtype in _header(file):
                if key in self.infos:
                    raise CheckpointKeyError(f"{key} is stored twice: in {self.infos[key].file.name} and {file.name}")
                self.infos[key] = TensorInfo(file, shape, dtype)

    def copy_into(self, key: str, out: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        """``out[...] = tensor[start:stop]`` (dim 0; the whole tensor by default), read chunk by chunk."""
        info = self.infos[key]
        if not info.shape:
            with self._open(info.file, framework="pt") as f:
                out.copy_(f.get_tensor(key))
            self._count(info, 1)
            return
        stop = info.shape[0] if stop is None else stop
        row_bytes = math.prod(info.shape[1:]) * _ITEMSIZE.get(info.dtype, 8)
        step = max(1, self.chunk_bytes // max(row_bytes, 1)) if info.dtype in _ITEMSIZE else 1
        for a in range(start, stop, step):
            b = min(stop, a + step)
            self._copy_chunk(info, key, a, b, out[a - start : b - start])

    def _copy_chunk(self, info: TensorInfo, key: str, a: int, b: int, out: torch.Tensor) -> None:
        # A fresh open per chunk: the view and the handle are the last references to the file's
        # mapping, so the pages this read touched (resident while mapped) are released on return.
        # Re-opening costs a header parse (about 1 ms per thousand keys), nothing next to the read.
        with self._open(info.file, framework="pt") as f:
            view = f.get_slice(key)[a:b]
            out.copy_(view)
            del view
        self._count(info, (b - a) * math.prod(info.shape[1:]))

    def _count(self, info: TensorInfo, elements: int) -> None:
        self.bytes_read += elements * _ITEMSIZE.get(info.dtype, 0)
        self.files_read.add(info.file.name)

    def read(self, key: str, rows: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """A fresh tensor (checkpoint dtype) holding the row ranges ``rows`` (dim 0, concatenated) or all."""
        info = self.infos[key]
        shape = list(info.shape)
        if rows is not None:
            shape[0] = sum(b - a for a, b in rows)
        out = torch.empty(shape, dtype=torch_dtype(info.dtype))
        if rows is None:
            self.copy_into(key, out)
            return out
        at = 0
        for a, b in rows:
            self.copy_into(key, out[at : at + b - a], a, b)
            at += b - a
        return out


def _header(file: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, dtype) of every tensor in a safetensors file, from its header; an unreadable file is a
    :class:`CheckpointFileError` naming it."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}
            return [(key, tuple(s.get_shape()), s.get_dtype()) for key, s in slices.items()]
    except FileNotFoundError as e:
        raise MissingCheckpointFileError(f"{file}: no such file; the checkpoint names it") from e
    except SafetensorError as e:
        raise UnreadableCheckpointError(f"{file}: not a readable safetensors file ({e}); write it again") from e
    except OSError as e:
        raise CheckpointFileError(f"{file}: cannot be read ({e})") from e


def torch_dtype(name: str) -> torch.dtype:
    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
    }  # fmt: skip
    if table.get(name) is None:
        raise CheckpointKeyError(f"checkpoint dtype {name} is not supported by the expert-parallel loader")
    return table[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = sorted({model_dir / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise MissingCheckpointFileError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointFileError(
        f"{model_dir}: no {SINGLE_FILE} and no {INDEX_FILE}; the expert-parallel loader reads safetensors checkpoints"
    )


# ----------------------------------------------------------------------------------------------
# mapping checkpoint keys to module tensors


@dataclass(frozen=True)
class ExpertSlice:
    """An expert parameter of an installed holder: this rank's experts (global ids, ascending) of ``num_experts``.

    ``per_row``: rows of dim 0 per expert (1; R for flat ``[E*R, C]`` weights such as DBRX's ``w1``).
    """

    experts: tuple[int, ...]
    num_experts: int
    per_row: int = 1

    @property
    def count(self) -> int:
        return len(self.experts)

    @property
    def full_dim0(self) -> int:
        """Dim 0 of the full (checkpoint) tensor."""
        return self.num_experts * self.per_row

    @property
    def local_dim0(self) -> int:
        """Dim 0 of this rank's tensor."""
        return self.count * self.per_row

    @property
    def rows(self) -> list[tuple[int, int]]:
        """The local experts as ranges ``[a, b)`` of consecutive global rows (of dim 0), in local row order."""
        ranges: list[tuple[int, int]] = []
        for e in self.experts:
            if ranges and ranges[-1][1] == e:
                ranges[-1] = (ranges[-1][0], e + 1)
            else:
                ranges.append((e, e + 1))
        return [(a * self.per_row, b * self.per_row) for a, b in ranges]


@dataclass
class LoadUnit:
    """What fills one or more module tensors: one checkpoint key, or one transformers converter."""

    targets: list[str]
    key: str | None = None  # plain (possibly renamed) tensor
    converter: object | None = None  # transformers WeightConverter
    sources: dict[str, list[tuple[int | None, str]]] = field(default_factory=dict)  # pattern -> (expert, key)


def expert_slices(model: nn.Module) -> dict[str, ExpertSlice]:
    """Every per-expert parameter of the installed (expert-parallel) holders, by full name. Experts held
    as modules have none: each of their parameters is one expert's, loaded by its own name."""
    out = {}
    for path, module in model.named_modules():
        binding = installed.binding(module)
        if binding is None or installed.layout(module).modules:
            continue
        placement, layout = binding.placement, installed.layout(module)
        for name in layout.weight_names:
            full = f"{path}.{name}" if path else name
            held = layout.rows_of(name, placement.local_experts, placement.num_experts)  # + zero experts' rows
            out[full] = ExpertSlice(held, placement.num_experts + len(held) - placement.num_local, layout.flat or 1)
    return out


def foreign_experts(model: nn.Module) -> set[str]:
    """The parameter names of the experts held as modules on other EP ranks (``...experts.5.w1.weight``):
    checkpoint tensors this rank leaves unread, neither missing nor unexpected."""
    out = set()
    for path, module in model.named_modules():
        layout = installed.layout(module)
        if installed.binding(module) is None or not layout.modules:
            continue
        prefix = f"{path}." if path else ""
        held = set(layout.held)
        out.update(f"{prefix}{k}.{r}" for k in layout.expert_keys if k not in held for r in layout.roles)
    return out


def index_regex(source_pattern: str) -> re.Pattern[str] | None:
    """The expert index in a per-expert key: the ``*`` of a converter source pattern (``experts.*.w1``)."""
    if "*" not in source_pattern:
        return None
    return re.compile(source_pattern.removeprefix("^").replace("*.", r"(\d+)\.").replace("*", r"(\d+)"))


def map_keys(model: nn.Module, reader: Reader, transforms: list
             ) -> tuple[dict[str, LoadUnit], dict[str, str], dict[str, str]]:
    """Group checkpoint keys into load units (by first target name); also the unexpected keys, each with
    its name after transformers' renamings (as ``from_pretrained`` reports it), and the keys of experts
    held as modules on other EP ranks (by the name they would fill), left unread."""
    cml = core_model_loading()
    rename_source_key, apply_renamings = cml.rename_source_key, cml.apply_renamings
    renamings = [t for t in transforms if isinstance(t, cml.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, cml.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict(keep_vars=True)
    prefix = model.base_model_prefix
    foreign = foreign_experts(model)
    units: dict[str, LoadUnit] = {}
    unexpected: dict[str, str] = {}
    foreign_found: dict[str, str] = {}
    for key in sorted(reader.infos, key=natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # as transformers: a key that should not have been renamed
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if renamed in foreign:
            foreign_found[renamed] = key  # another EP rank's expert module: never read here
            continue
        if renamed not in meta:
            unexpected[key] = renamed  # transformers reports the renamed name
            continue
        if pattern is None:
            if renamed in units:
                other = units[renamed].key or next(iter(units[renamed].sources.values()))[0][1]
                raise CheckpointKeyError(f"{key} and {other} both map to {renamed}")
            units[renamed] = LoadUnit([renamed], key=key)
            continue
        converter = by_pattern[pattern]
        unit = units.get(renamed)
        if unit is None:
            first = converter.target_patterns[0]
            targets = [
                renamed.replace(first, t) if first in renamed else renamed for t in converter.target_patterns
            ]
            unit = units[renamed] = LoadUnit(targets, converter=converter)
        elif unit.converter is not converter:
            raise CheckpointKeyError(
                f"{key} maps to {renamed}, which another checkpoint tensor fills already"
            )
        regex = index_regex(pattern)
        index = None
        if regex is not None:
            found = regex.search(apply_renamings(key, renamings))
            index = int(found.group(1)) if found else None
        unit.sources.setdefault(pattern, []).append((index, key))
    return units, unexpected, foreign_found


def natural_key(key: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("."))
