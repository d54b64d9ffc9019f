"""Load a checkpoint expert-parallel, reading only this rank's experts.

:func:`load_expert_parallel` builds the model on the meta device, analyses and installs the plan on
it (``shard_experts`` slices the meta parameters to the local expert count, so no storage exists
yet), then gives every parameter and buffer real CPU storage of its final, local shape and fills it
from the checkpoint's safetensors files. Non-local expert weights are never read nor materialised.

Checkpoint names are mapped to module names with transformers' own conversion mapping for the
model (``get_model_conversion_mapping``: ``WeightRenaming`` such as Mixtral's
``block_sparse_moe -> mlp``, ``WeightConverter`` such as ``experts.*.{gate,up}_proj.weight ->
experts.gate_up_proj`` with ``MergeModulelist(0) + Concatenate(1)``) and its ``rename_source_key``:

* a tensor stored under (a renaming of) its in-memory name: for an expert parameter only the local
  rows of dim 0 are read (fused ``gate_up_proj`` / ``down_proj`` and their biases);
* a converter whose operations are ``MergeModulelist(dim=0)`` optionally followed by
  ``Concatenate(dim>=1)`` (every per-expert legacy layout transformers knows: ``gate_proj/up_proj/
  down_proj``, ``w1/w3/w2``): each local expert's tensors are copied straight into their rows of the
  preallocated parameter; other experts' keys are never opened;
* any other converter: transformers' ``WeightConverter.convert`` runs on lazily read tensors, for
  an expert parameter only the local experts' (per-expert keys) or local rows (stacked keys), and
  only when no operation touches the expert dimension (else :class:`ExpertParallelError`).

Reads go through ``safe_open(...).get_slice(name)[rows]``, which returns a view of the file's memory
map; the view is copied into the parameter in chunks of at most ``chunk_bytes`` (16 MiB), and the
file is opened afresh for each chunk (its mapping ends with the copy), so the mapped file pages
counted in the resident set never exceed one chunk.
Buffers the checkpoint does not hold (rotary ``inv_freq``...) are initialised by the model's own
``initialize_weights`` (as ``from_pretrained`` does: every loaded tensor is flagged
``_is_hf_initialized`` first), tied weights are tied with ``tie_weights``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..runtime import ExpertParallelError, ExpertParallelGroup
from .tiny import quiet_transformers

__all__ = ["CheckpointKeyError", "load_expert_parallel"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 16 * 2**20  # largest single read (copy) from a file's memory map

_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip


class CheckpointKeyError(ExpertParallelError):
    """The checkpoint does not fit the model: missing, unexpected, duplicated or mis-shaped tensors."""


# ----------------------------------------------------------------------------------------------
# reading


@dataclass(frozen=True)
class _TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


class _Reader:
    """Row-range reads of checkpoint tensors into preallocated tensors, through bounded mmap views."""

    def __init__(self, model_dir: Path, chunk_bytes: int = CHUNK_BYTES) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self.chunk_bytes = chunk_bytes
        self.bytes_read = 0
        self.files_read: set[str] = set()
        self.infos: dict[str, _TensorInfo] = {}
        for file in _checkpoint_files(model_dir):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key in self.infos:
                        raise CheckpointKeyError(
                            f"{key} is stored twice: in {self.infos[key].file.name} and {file.name}"
                        )
                    s = f.get_slice(key)
                    self.infos[key] = _TensorInfo(file, tuple(s.get_shape()), s.get_dtype())

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

    def _copy_chunk(self, info: _TensorInfo, key: str, a: int, b: int, out: torch.Tensor) -> None:
        # A fresh open per chunk: the view and the handle are the last references to the file's
        # mapping, so the pages this read touched (resident while mapped) are released on return.
        # Re-opening costs a header parse (about 1 ms per thousand keys), nothing next to the read.
        with self._open(info.file, framework="pt") as f:
            view = f.get_slice(key)[a:b]
            out.copy_(view)
            del view
        self._count(info, (b - a) * math.prod(info.shape[1:]))

    def _count(self, info: _TensorInfo, elements: int) -> None:
        self.bytes_read += elements * _ITEMSIZE.get(info.dtype, 0)
        self.files_read.add(info.file.name)

    def read(self, key: str, rows: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """A fresh tensor (checkpoint dtype) holding the row ranges ``rows`` (dim 0, concatenated) or all."""
        info = self.infos[key]
        shape = list(info.shape)
        if rows is not None:
            shape[0] = sum(b - a for a, b in rows)
        out = torch.empty(shape, dtype=_torch_dtype(info.dtype))
        if rows is None:
            self.copy_into(key, out)
            return out
        at = 0
        for a, b in rows:
            self.copy_into(key, out[at : at + b - a], a, b)
            at += b - a
        return out


def _torch_dtype(name: str) -> torch.dtype:
    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
    }  # fmt: skip
    if table.get(name) is None:
        raise CheckpointKeyError(f"checkpoint dtype {name} is not supported by the expert-parallel loader")
    return table[name]


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = sorted({model_dir / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointKeyError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointKeyError(
        f"{model_dir}: no {SINGLE_FILE} and no {INDEX_FILE}; the expert-parallel loader reads safetensors checkpoints"
    )


# ----------------------------------------------------------------------------------------------
# mapping checkpoint keys to module tensors


@dataclass(frozen=True)
class _ExpertSlice:
    """An expert parameter of an installed holder: this rank's experts (global ids, ascending) of ``num_experts``."""

    experts: tuple[int, ...]
    num_experts: int

    @property
    def count(self) -> int:
        return len(self.experts)

    @property
    def rows(self) -> list[tuple[int, int]]:
        """The local experts as ranges ``[a, b)`` of consecutive global rows, in local row order."""
        ranges: list[tuple[int, int]] = []
        for e in self.experts:
            if ranges and ranges[-1][1] == e:
                ranges[-1] = (ranges[-1][0], e + 1)
            else:
                ranges.append((e, e + 1))
        return ranges


@dataclass
class _Unit:
    """What fills one or more module tensors: one checkpoint key, or one transformers converter."""

    targets: list[str]
    key: str | None = None  # plain (possibly renamed) tensor
    converter: object | None = None  # transformers WeightConverter
    sources: dict[str, list[tuple[int | None, str]]] = field(default_factory=dict)  # pattern -> (expert, key)


def _expert_slices(model: nn.Module) -> dict[str, _ExpertSlice]:
    """Every per-expert parameter of the installed (expert-parallel) holders, by full name."""
    out = {}
    for path, module in model.named_modules():
        binding = getattr(module, "hp_expert_parallel", None)
        if binding is None:
            continue
        placement = binding.placement
        for name in module.hp_layout.weight_names:
            full = f"{path}.{name}" if path else name
            out[full] = _ExpertSlice(placement.local_experts, placement.num_experts)
    return out


def _index_regex(source_pattern: str) -> re.Pattern[str] | None:
    """The expert index in a per-expert key: the ``*`` of a converter source pattern (``experts.*.w1``)."""
    if "*" not in source_pattern:
        return None
    return re.compile(source_pattern.removeprefix("^").replace("*.", r"(\d+)\.").replace("*", r"(\d+)"))


def _map_keys(model: nn.Module, reader: _Reader, transforms: list) -> tuple[dict[str, _Unit], list[str]]:
    """Group checkpoint keys into load units (by first target name); also the unexpected keys."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_renamings,
        rename_source_key,
    )

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict(keep_vars=True)
    prefix = model.base_model_prefix
    units: dict[str, _Unit] = {}
    unexpected: list[str] = []
    for key in sorted(reader.infos, key=_natural):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # as transformers: a key that should not have been renamed
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if renamed not in meta:
            unexpected.append(key)
            continue
        if pattern is None:
            if renamed in units:
                other = units[renamed].key or next(iter(units[renamed].sources.values()))[0][1]
                raise CheckpointKeyError(f"{key} and {other} both map to {renamed}")
            units[renamed] = _Unit([renamed], key=key)
            continue
        converter = by_pattern[pattern]
        unit = units.get(renamed)
        if unit is None:
            first = converter.target_patterns[0]
            targets = [
                renamed.replace(first, t) if first in renamed else renamed for t in converter.target_patterns
            ]
            unit = units[renamed] = _Unit(targets, converter=converter)
        elif unit.converter is not converter:
            raise CheckpointKeyError(
                f"{key} maps to {renamed}, which another checkpoint tensor fills already"
            )
        regex = _index_regex(pattern)
        index = None
        if regex is not None:
            found = regex.search(apply_renamings(key, renamings))
            index = int(found.group(1)) if found else None
        unit.sources.setdefault(pattern, []).append((index, key))
    return units, unexpected


def _natural(key: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("."))


# ----------------------------------------------------------------------------------------------
# filling


def _op_dims(op) -> list[int]:
    return [getattr(op, a) for a in ("dim", "dim0", "dim1") if isinstance(getattr(op, a, None), int)]


def _is_merge(op) -> bool:
    from transformers.core_model_loading import MergeModulelist

    return isinstance(op, MergeModulelist) and op.dim == 0


def _is_concat(op) -> bool:
    from transformers.core_model_loading import Concatenate

    return isinstance(op, Concatenate) and op.dim >= 1


class _Filler:
    def __init__(
        self, model: nn.Module, reader: _Reader, experts: dict[str, _ExpertSlice], dtypes: Callable
    ) -> None:
        self.model, self.reader, self.experts, self.dtype_for = model, reader, experts, dtypes
        self.meta = model.state_dict(keep_vars=True)
        self.paths = {"tensor": 0, "merged_experts": 0, "transformers_converter": 0}  # units filled, by path

    def empty(self, name: str) -> torch.Tensor:
        return torch.empty(self.meta[name].shape, dtype=self.dtype_for(name))

    def fill(self, unit: _Unit) -> dict[str, torch.Tensor]:
        if unit.key is not None:
            self.paths["tensor"] += 1
            return {unit.targets[0]: self._plain(unit.targets[0], unit.key)}
        ops = list(unit.converter.operations)
        patterns = unit.converter.source_patterns
        per_expert = any(_index_regex(p) is not None for p in unit.sources)
        if per_expert and len(unit.targets) == 1 and all(_index_regex(p) for p in patterns):
            if len(ops) == 1 and len(patterns) == 1 and _is_merge(ops[0]):
                self.paths["merged_experts"] += 1
                return {unit.targets[0]: self._merge(unit, None)}
            if len(ops) == 2 and _is_merge(ops[0]) and _is_concat(ops[1]):
                self.paths["merged_experts"] += 1
                return {unit.targets[0]: self._merge(unit, ops[1].dim)}
        self.paths["transformers_converter"] += 1
        return self._convert(unit, per_expert)

    def _check(self, name: str, shape: tuple[int, ...], what: str) -> None:
        want = tuple(self.meta[name].shape)
        if tuple(shape) != want:
            raise CheckpointKeyError(
                f"{what} gives {name} the shape {list(shape)}, the model expects {list(want)}"
            )

    def _plain(self, name: str, key: str) -> torch.Tensor:
        shape = list(self.reader.infos[key].shape)
        out = self.empty(name)
        sl = self.experts.get(name)
        if sl is None:
            self._check(name, tuple(shape), f"checkpoint tensor {key}")
            self.reader.copy_into(key, out)
            return out
        if not shape or shape[0] != sl.num_experts:
            raise CheckpointKeyError(
                f"checkpoint tensor {key} {shape} should hold {sl.num_experts} experts in dim 0 for {name}"
            )
        self._check(name, (sl.count, *shape[1:]), f"experts {_ranges(list(sl.experts))} of {key}")
        at = 0
        for a, b in sl.rows:
            self.reader.copy_into(key, out[at : at + b - a], a, b)
            at += b - a
        return out

    def _local(self, unit: _Unit, name: str) -> dict[str, list[tuple[int, str]]]:
        """Per source pattern, the (index, key) of the experts to read, in expert order, checked complete."""
        sl = self.experts.get(name)
        out = {}
        for pattern in unit.converter.source_patterns:
            items = unit.sources.get(pattern, [])
            bad = [k for i, k in items if i is None]
            if bad:
                raise CheckpointKeyError(f"{bad[0]}: no expert index where {pattern!r} has '*'")
            indices = sorted(i for i, _ in items)
            expected = list(range(sl.num_experts if sl else len(items)))
            if indices != expected:
                missing = sorted(set(expected) - set(indices))
                extra = sorted(set(indices) - set(expected))
                raise CheckpointKeyError(
                    f"{name}: checkpoint keys {pattern!r} hold experts {_ranges(indices)}; "
                    + (f"missing {_ranges(missing)}" if missing else "")
                    + (f" unexpected {_ranges(extra)}" if extra else "")
                    + f" (expected 0..{len(expected) - 1})"
                )
            keep = set(sl.experts) if sl else range(len(items))
            out[pattern] = sorted((i, k) for i, k in items if i in keep)
        return out

    def _merge(self, unit: _Unit, cat_dim: int | None) -> torch.Tensor:
        """``MergeModulelist(0)`` [+ ``Concatenate(d)``] written straight into the (local) parameter."""
        name = unit.targets[0]
        local = self._local(unit, name)
        out = self.empty(name)
        offset = 0
        for pattern in unit.converter.source_patterns:
            items = local[pattern]
            if not items:
                continue
            shape = self.reader.infos[items[0][1]].shape
            width = shape[cat_dim - 1] if cat_dim is not None else None
            for j, (_, key) in enumerate(items):
                if self.reader.infos[key].shape != shape:
                    raise CheckpointKeyError(
                        f"{key} {list(self.reader.infos[key].shape)}: expected {list(shape)}"
                    )
                slot = out[j] if cat_dim is None else out[j].narrow(cat_dim - 1, offset, width)
                self._check_slot(name, slot, shape, key)
                self.reader.copy_into(key, slot)
            if len(items) != out.shape[0]:
                raise CheckpointKeyError(f"{name}: {len(items)} experts read for {out.shape[0]} rows")
            offset += width or 0
        if cat_dim is not None and offset != out.shape[cat_dim]:
            raise CheckpointKeyError(
                f"{name}: the checkpoint's {' + '.join(unit.converter.source_patterns)} give {offset} "
                f"along dim {cat_dim}, the model expects {out.shape[cat_dim]}"
            )
        return out

    def _check_slot(self, name: str, slot: torch.Tensor, shape: tuple[int, ...], key: str) -> None:
        if tuple(slot.shape) != tuple(shape):
            raise CheckpointKeyError(
                f"checkpoint tensor {key} {list(shape)} does not fit {name} (per-expert slot {list(slot.shape)})"
            )

    def _convert(self, unit: _Unit, per_expert: bool) -> dict[str, torch.Tensor]:
        """Run transformers' converter on lazily read tensors (only the local experts' for expert targets)."""
        name = unit.targets[0]
        conv = copy.deepcopy(unit.converter)
        slices = {self.experts.get(t) for t in unit.targets}
        sl = self.experts.get(name)
        partial = any(x is not None and x.count < x.num_experts for x in slices)
        if partial:  # EP > 1: every operation must keep experts apart, and all targets share one slice
            ops = list(conv.operations)
            if len(slices) != 1:
                raise ExpertParallelError(
                    f"{name}: the conversion {unit.converter!r} fills tensors with different expert slices "
                    f"({', '.join(unit.targets)}); only-local loading cannot read it"
                )
            if per_expert:
                if not ops or not _is_merge(ops[0]):
                    raise ExpertParallelError(
                        f"{name}: the conversion {unit.converter!r} does not start by stacking experts "
                        "(MergeModulelist(dim=0)); only-local loading cannot read it"
                    )
                ops = ops[1:]
            touching = [op for op in ops if 0 in _op_dims(op) or not _op_dims(op)]
            if touching:
                raise ExpertParallelError(
                    f"{name}: the conversion operation {touching[0]!r} acts on the expert dimension; "
                    "only-local loading cannot apply it to a slice of the experts"
                )
        if partial and per_expert:
            for pattern, items in self._local(unit, name).items():
                for _, key in items:
                    conv.collected_tensors[pattern].append(_lazy(self.reader, key, None))
        else:  # whole tensors (every expert is local, or not an expert tensor), in checkpoint order
            for pattern in conv.source_patterns:
                for _, key in unit.sources.get(pattern, []):
                    rows = None
                    if partial:
                        shape = self.reader.infos[key].shape
                        if not shape or shape[0] != sl.num_experts:
                            raise CheckpointKeyError(
                                f"checkpoint tensor {key} {list(shape)} should hold {sl.num_experts} experts in dim 0"
                            )
                        rows = sl.rows
                    conv.collected_tensors[pattern].append(_lazy(self.reader, key, rows))
        with torch.no_grad():
            result = conv.convert(name, model=self.model, config=self.model.config)
        out = {}
        for target, value in result.items():
            value = value[0] if isinstance(value, list) else value
            if target not in self.meta:
                raise CheckpointKeyError(
                    f"the conversion {unit.converter!r} produced {target}, which the model lacks"
                )
            self._check(target, tuple(value.shape), f"the conversion {unit.converter!r}")
            dest = self.empty(target)
            dest.copy_(value)
            out[target] = dest
        return out


def _lazy(reader: _Reader, key: str, rows: list[tuple[int, int]] | None) -> Callable[[], torch.Tensor]:
    return lambda: reader.read(key, rows)


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    parts, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


# ----------------------------------------------------------------------------------------------
# the model


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    from .tiny import auto_class_for

    cls = auto_class_for(config)
    build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    with torch.device("meta"), quiet_transformers():
        return build(config, attn_implementation="eager", dtype=dtype)


def _dtype_rule(model: nn.Module, dtype: torch.dtype) -> Callable[[str], torch.dtype]:
    """The dtype of each tensor as ``from_pretrained`` picks it: ``keep_in_fp32`` plan, else the built one."""
    from transformers.core_model_loading import build_glob_alternation

    meta = model.state_dict(keep_vars=True)
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    alt = by_group = None
    if plan:
        alt, by_group, _ = build_glob_alternation(list(plan.keys()))

    def rule(name: str) -> torch.dtype:
        if alt is not None and (m := alt.search(name)) is not None and meta[name].is_floating_point():
            return plan[by_group[m.lastgroup]]
        return meta[name].dtype

    return rule


def _tensor_slots(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, bool, bool]]:
    """(full name, owner, attribute, is_parameter, persistent) of every parameter and buffer."""
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for attr, p in module._parameters.items():
            if p is not None:
                yield prefix + attr, module, attr, True, True
        for attr, b in module._buffers.items():
            if b is not None:
                yield prefix + attr, module, attr, False, attr not in module._non_persistent_buffers_set


def _set(
    module: nn.Module, attr: str, old: torch.Tensor, value: torch.Tensor, is_param: bool
) -> torch.Tensor:
    if is_param:
        value = nn.Parameter(value, requires_grad=old.requires_grad and value.is_floating_point())
        module._parameters[attr] = value
    else:
        module._buffers[attr] = value
    return value


def _check_keys(
    model: nn.Module, units: dict[str, _Unit], unexpected: list[str], model_dir: Path
) -> set[str]:
    """Raise on missing or unexpected keys (transformers' ignore rules apply); returns the allowed missing."""
    produced = {t for u in units.values() for t in u.targets}
    expected = set(model.state_dict(keep_vars=True))
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    missing = expected - produced
    info = SimpleNamespace(missing_keys=set(missing), unexpected_keys=set(unexpected))
    if hasattr(model, "_adjust_missing_and_unexpected_keys"):
        model._adjust_missing_and_unexpected_keys(info)  # _keys_to_ignore_on_load_*, legacy rotary inv_freq
    tied_ok = set()
    for target, source in tied.items():
        if target in info.missing_keys and source not in info.missing_keys:
            tied_ok.add(target)
        elif source in info.missing_keys and target not in info.missing_keys:
            tied_ok.add(source)  # tie_weights ties the present one to the missing one
    real_missing = sorted(info.missing_keys - tied_ok, key=_natural)
    if real_missing or info.unexpected_keys:
        parts = []
        if real_missing:
            parts.append(
                f"{len(real_missing)} missing (the model has them, the checkpoint does not): {_list(real_missing)}"
            )
        if info.unexpected_keys:
            extra = sorted(info.unexpected_keys, key=_natural)
            parts.append(f"{len(extra)} unexpected (in the checkpoint, not in the model): {_list(extra)}")
        raise CheckpointKeyError(f"{model_dir} does not fit {type(model).__name__}: " + "; ".join(parts))
    return missing  # ignored or tied: initialised or tied below


def _list(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_expert_parallel(
    model_dir: str | Path,
    plan,
    ep: ExpertParallelGroup,
    artifact_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[nn.Module, dict]:
    """The checkpoint in ``model_dir`` as an expert-parallel model holding only this rank's experts.

    ``plan`` (a :class:`hp_rewrite.plan.Plan`) selects the blocks; ``ep`` is this rank's EP group
    (``ExpertParallelGroup.single()`` for EP=1); the generated code goes under ``artifact_dir``.
    Floating tensors are loaded in ``dtype`` (``keep_in_fp32`` modules aside, as ``from_pretrained``
    does). When ``torch.distributed`` is initialised the call is collective (rank 0 writes the
    artifact, the others wait for it and reuse it).

    Returns ``(model, report)``; the model is in ``eval()`` mode. ``report`` holds:

    * ``expert_bytes`` / ``non_expert_bytes``: this rank's expert parameters / every other
      parameter and buffer (tied tensors once);
    * ``bytes_read`` (from the files, in the checkpoint dtype) and ``files_read`` (file names);
    * ``paths``: how many load units were a plain or renamed tensor, per-expert tensors merged in
      place, or a transformers converter;
    * ``seconds`` (the whole call) and ``timings`` (``build_s``, ``analyze_s``, ``install_s``,
      ``load_s``); ``patched`` (block paths); ``ep_size`` / ``ep_rank``.

    Raises :class:`CheckpointKeyError` naming the tensors when the checkpoint does not fit the
    model, and :class:`ExpertParallelError` when a conversion cannot be applied to a slice of the
    experts (EP > 1 only).
    """
    loading = prepare(model_dir, plan, ep, artifact_dir, dtype, chunk_bytes)
    model, filler = loading.model, loading.filler
    t0 = time.perf_counter()
    slots: dict[str, list[tuple[nn.Module, str, bool]]] = {}
    for name, module, attr, is_param, _ in _tensor_slots(model):
        slots.setdefault(name, []).append((module, attr, is_param))
    new_for: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its materialised replacement (keeps ties)
    for unit in loading.ordered_units():
        for name, value in filler.fill(unit).items():
            for module, attr, is_param in slots[name]:
                old = getattr(module, attr)
                new = _set(module, attr, old, value, is_param)
                new._is_hf_initialized = True  # transformers' init functions skip flagged tensors
                new_for[id(old)] = new
    with quiet_transformers():
        _finish(model, new_for, loading.allowed_missing)
    model.eval()
    model._weight_conversions = [t for t in loading.transforms if t.was_used()]
    loading.timings["load_s"] = time.perf_counter() - t0
    return model, loading.report()


@dataclass
class PreparedLoad:
    """A model built on the meta device with the plan installed (local expert shapes, no storage), and
    what maps the checkpoint onto it: the state between :func:`prepare` and filling the tensors."""

    model: nn.Module
    reader: _Reader
    filler: _Filler
    units: dict[str, _Unit]
    allowed_missing: set[str]
    transforms: list
    experts: dict[str, _ExpertSlice]
    patched: list[str]
    ep: ExpertParallelGroup
    timings: dict[str, float]
    started: float

    def ordered_units(self) -> list[_Unit]:
        return sorted(self.units.values(), key=lambda u: _natural(u.targets[0]))

    def report(self) -> dict:
        expert_bytes, other_bytes = _bytes(self.model, self.experts)
        return {
            "expert_bytes": expert_bytes,
            "non_expert_bytes": other_bytes,
            "bytes_read": self.reader.bytes_read,
            "files_read": sorted(self.reader.files_read),
            "paths": self.filler.paths,
            "seconds": time.perf_counter() - self.started,
            "timings": self.timings,
            "patched": self.patched,
            "ep_size": self.ep.size,
            "ep_rank": self.ep.rank,
        }


def prepare(model_dir, plan, ep: ExpertParallelGroup, artifact_dir, dtype: torch.dtype = torch.float32,
            chunk_bytes: int = CHUNK_BYTES) -> PreparedLoad:
    """Build on meta, find or write the artifact (rank 0 first), install the plan, map the checkpoint's
    keys: everything :func:`load_expert_parallel` does before it reads a tensor."""
    import torch.distributed as dist
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping

    from .. import rewrite

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise CheckpointKeyError(f"{model_dir}: no config.json; pass a transformers checkpoint directory")
    reader = _Reader(model_dir, chunk_bytes)  # headers only: fail early on a directory without weights
    with quiet_transformers():
        config = AutoConfig.from_pretrained(model_dir)
    t0 = time.perf_counter()
    model = _meta_model(config, dtype)
    timings["build_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_rank() != 0:
        dist.barrier()  # rank 0 finds or writes the artifact first; the others reuse it, no analysis
        artifact = rewrite.ensure_artifact(model, plan, config, Path(artifact_dir))
    else:
        artifact = rewrite.ensure_artifact(model, plan, config, Path(artifact_dir))
        if distributed:
            dist.barrier()
    _release_freed_memory()  # the analysis ran random-weight copies of whole blocks: give that back first
    timings["analyze_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    patched = rewrite.install(model, artifact, plan, ep, shard=True)  # on meta: local shapes, no storage
    experts = _expert_slices(model)
    timings["install_s"] = time.perf_counter() - t0
    transforms = get_model_conversion_mapping(model)
    units, unexpected = _map_keys(model, reader, transforms)
    allowed_missing = _check_keys(model, units, unexpected, model_dir)
    filler = _Filler(model, reader, experts, _dtype_rule(model, dtype))
    return PreparedLoad(model, reader, filler, units, allowed_missing, transforms, experts, patched, ep,
                        timings, t_start)


def _finish(model: nn.Module, new_for: dict[int, torch.Tensor], allowed_missing: set[str]) -> None:
    """Meta tensors the checkpoint did not fill: shared ones, ties, then transformers' own init."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    to_init = allowed_missing - tied.keys()  # ignored by the model's _keys_to_ignore_on_load_missing
    for name, module, attr, is_param, persistent in list(_tensor_slots(model)):
        old = getattr(module, attr)
        if not old.is_meta:
            continue
        if id(old) in new_for:  # the same tensor object under another name (module-level sharing, ties)
            (module._parameters if is_param else module._buffers)[attr] = new_for[id(old)]
        elif not persistent or name in to_init:
            new_for[id(old)] = _set(module, attr, old, torch.empty(old.shape, dtype=old.dtype), is_param)
    if tied:
        model.tie_weights(missing_keys=set(allowed_missing), recompute_mapping=False)
    if hasattr(model, "initialize_weights"):
        model.initialize_weights()  # only what no checkpoint tensor filled: non-persistent buffers, ignored keys
    left = [name for name, module, attr, _, _ in _tensor_slots(model) if getattr(module, attr).is_meta]
    if left:
        raise CheckpointKeyError(
            f"not filled by the checkpoint nor initialised: {_list(sorted(set(left), key=_natural))}"
        )


def _release_freed_memory() -> None:
    """Collect garbage and return freed heap memory to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Without it, glibc keeps most of what the analysis freed in its heap, fragmented, and the weights
    allocated next land partly beside it instead of in it.
    """
    gc.collect()
    with contextlib.suppress(Exception):
        import ctypes
        import ctypes.util

        libc = ctypes.util.find_library("c")
        if libc:
            ctypes.CDLL(libc).malloc_trim(0)


def _bytes(model: nn.Module, experts: dict[str, _ExpertSlice]) -> tuple[int, int]:
    seen: set[int] = set()
    expert = other = 0
    for name, module, attr, _, _ in _tensor_slots(model):
        t = getattr(module, attr)
        if id(t) in seen:
            continue
        seen.add(id(t))
        size = t.numel() * t.element_size()
        if name in experts:
            expert += size
        else:
            other += size
    return expert, other
