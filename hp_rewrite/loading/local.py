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

The file reader and the key mapping live in :mod:`hp_rewrite.loading.checkpoint_files`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..hf import core_model_loading, load_config, meta_model, model_conversion_mapping, quiet_transformers
from ..runtime import ExpertParallelError, ExpertParallelGroup
from .checkpoint_files import (
    CHUNK_BYTES,
    CheckpointKeyError,
    ExpertSlice,
    LoadUnit,
    Reader,
    expert_slices,
    index_regex,
    map_keys,
    natural_key,
    torch_dtype,
)
from .quantized import DequantizingReader, checkpoint_format
from .rank0 import rank0_first

__all__ = ["CHUNK_BYTES", "CheckpointKeyError", "PreparedLoad", "load_expert_parallel", "prepare"]


# ----------------------------------------------------------------------------------------------
# filling


def _op_dims(op) -> list[int]:
    return [getattr(op, a) for a in ("dim", "dim0", "dim1") if isinstance(getattr(op, a, None), int)]


def _is_merge(op) -> bool:
    return isinstance(op, core_model_loading().MergeModulelist) and op.dim == 0


def _is_concat(op) -> bool:
    return isinstance(op, core_model_loading().Concatenate) and op.dim >= 1


class _Filler:
    def __init__(self, model: nn.Module, reader: Reader, experts: dict[str, ExpertSlice], dtypes: Callable,
                 device: torch.device | None = None) -> None:
        self.model, self.reader, self.experts, self.dtype_for = model, reader, experts, dtypes
        self.device = device
        self.meta = model.state_dict(keep_vars=True)
        self.paths = {"tensor": 0, "merged_experts": 0, "transformers_converter": 0}  # units filled, by path

    def empty(self, name: str) -> torch.Tensor:
        return torch.empty(self.meta[name].shape, dtype=self.dtype_for(name), device=self.device)

    def fill(self, unit: LoadUnit) -> dict[str, torch.Tensor]:
        if unit.key is not None:
            self.paths["tensor"] += 1
            return {unit.targets[0]: self._plain(unit.targets[0], unit.key)}
        ops = list(unit.converter.operations)
        patterns = unit.converter.source_patterns
        per_expert = any(index_regex(p) is not None for p in unit.sources)
        if per_expert and len(unit.targets) == 1 and all(index_regex(p) for p in patterns):
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
        if not shape or shape[0] != sl.full_dim0:
            raise CheckpointKeyError(
                f"checkpoint tensor {key} {shape} should hold {sl.num_experts} experts ({sl.full_dim0} rows) in "
                f"dim 0 for {name}"
            )
        self._check(name, (sl.local_dim0, *shape[1:]), f"experts {_ranges(list(sl.experts))} of {key}")
        at = 0
        for a, b in sl.rows:
            self.reader.copy_into(key, out[at : at + b - a], a, b)
            at += b - a
        return out

    def _local(self, unit: LoadUnit, name: str) -> dict[str, list[tuple[int, str]]]:
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

    def _merge(self, unit: LoadUnit, cat_dim: int | None) -> torch.Tensor:
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

    def _convert(self, unit: LoadUnit, per_expert: bool) -> dict[str, torch.Tensor]:
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
                        if not shape or shape[0] != sl.full_dim0:
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


def _lazy(reader: Reader, key: str, rows: list[tuple[int, int]] | None) -> Callable[[], torch.Tensor]:
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


def _dtype_rule(model: nn.Module, dtype: torch.dtype) -> Callable[[str], torch.dtype]:
    """The dtype of each tensor as ``from_pretrained`` picks it: ``keep_in_fp32`` plan, else the built one."""
    meta = model.state_dict(keep_vars=True)
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    alt = by_group = None
    if plan:
        alt, by_group, _ = core_model_loading().build_glob_alternation(list(plan.keys()))

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
    model: nn.Module, units: dict[str, LoadUnit], unexpected: list[str], model_dir: Path
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
    real_missing = sorted(info.missing_keys - tied_ok, key=natural_key)
    if real_missing or info.unexpected_keys:
        parts = []
        if real_missing:
            parts.append(
                f"{len(real_missing)} missing (the model has them, the checkpoint does not): {_list(real_missing)}"
            )
        if info.unexpected_keys:
            extra = sorted(info.unexpected_keys, key=natural_key)
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
    dtype: torch.dtype | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, dict]:
    """The checkpoint in ``model_dir`` as an expert-parallel model holding only this rank's experts.

    ``plan`` (a :class:`hp_rewrite.plan.Plan`) selects the blocks; ``ep`` is this rank's EP group
    (``ExpertParallelGroup.single()`` for EP=1); the generated code goes under ``artifact_dir``.
    Floating tensors are loaded in ``dtype`` (``keep_in_fp32`` modules aside, as ``from_pretrained``
    does); by default, as ``from_pretrained``, the checkpoint's dtype and transformers' attention choice
    (``attn_implementation``: ``sdpa`` where the model has it). When ``torch.distributed`` is
    initialised the call is collective (rank 0 writes the artifact, the others wait for it and reuse
    it). ``from_pretrained`` under ``auto_patch`` reads through the same steps with transformers' own
    class, dtype and key handling (:mod:`hp_rewrite.loading.pretrained`). ``trust_remote_code``: run
    the checkpoint's own modeling code (its ``auto_map``), as ``from_pretrained`` does.

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
    loading = prepare(model_dir, plan, ep, artifact_dir, dtype, chunk_bytes, attn_implementation, trust_remote_code)
    new_for = loading.fill()
    with quiet_transformers():
        _finish(loading.model, new_for, loading.allowed_missing)
    loading.model.eval()
    return loading.model, loading.report()


@dataclass
class PreparedLoad:
    """A model built on the meta device with the plan installed (local expert shapes, no storage), and
    what maps the checkpoint onto it: the state between :func:`prepare` and filling the tensors."""

    model: nn.Module
    reader: Reader
    filler: _Filler
    units: dict[str, LoadUnit]
    unexpected: dict[str, str]  # checkpoint keys no tensor of the model takes -> their renamed names
    transforms: list
    experts: dict[str, ExpertSlice]
    patched: list[str]
    ep: ExpertParallelGroup
    timings: dict[str, float]
    started: float
    allowed_missing: set[str] = field(default_factory=set)  # ignored or tied (checked by prepare)

    def ordered_units(self) -> list[LoadUnit]:
        return sorted(self.units.values(), key=lambda u: natural_key(u.targets[0]))

    @property
    def missing(self) -> set[str]:
        """The model's tensors no checkpoint key fills."""
        produced = {t for u in self.units.values() for t in u.targets}
        return set(self.model.state_dict(keep_vars=True)) - produced

    def fill(self) -> dict[int, torch.Tensor]:
        """Read every unit into fresh tensors set on the model (flagged initialised for transformers);
        returns id(meta tensor) -> its replacement, which keeps tensors shared under several names."""
        t0 = time.perf_counter()
        slots: dict[str, list[tuple[nn.Module, str, bool]]] = {}
        for name, module, attr, is_param, _ in _tensor_slots(self.model):
            slots.setdefault(name, []).append((module, attr, is_param))
        new_for: dict[int, torch.Tensor] = {}
        for unit in self.ordered_units():
            for name, value in self.filler.fill(unit).items():
                for module, attr, is_param in slots[name]:
                    old = getattr(module, attr)
                    new = _set(module, attr, old, value, is_param)
                    new._is_hf_initialized = True  # transformers' init functions skip flagged tensors
                    new_for[id(old)] = new
        self.model._weight_conversions = [t for t in self.transforms if t.was_used()]
        self.timings["load_s"] = time.perf_counter() - t0
        return new_for

    def report(self) -> dict:
        expert_bytes, other_bytes = _bytes(self.model, self.experts)
        return {
            "expert_bytes": expert_bytes,
            "non_expert_bytes": other_bytes,
            "bytes_read": self.reader.bytes_read,
            "quantization": getattr(getattr(self.reader, "format", None), "method", None),  # dequantised at load
            "files_read": sorted(self.reader.files_read),
            "paths": self.filler.paths,
            "seconds": time.perf_counter() - self.started,
            "timings": self.timings,
            "patched": self.patched,
            "ep_size": self.ep.size,
            "ep_rank": self.ep.rank,
        }


def checkpoint_dtype(config, reader: Reader) -> torch.dtype:
    """transformers' default ``dtype="auto"``: the config's ``dtype``, else the first floating tensor's
    in the checkpoint, else torch's default."""
    declared = getattr(config, "dtype", None)
    if declared is not None:
        return getattr(torch, declared) if isinstance(declared, str) else declared
    for key, info in reader.infos.items():
        if key in getattr(reader, "pairs", {}):
            continue  # dequantised: no dtype of its own in the files
        dtype = torch_dtype(info.dtype)
        if dtype.is_floating_point:
            return dtype
    return torch.get_default_dtype()


def prepare(model_dir, plan, ep: ExpertParallelGroup, artifact_dir, dtype: torch.dtype | None = None,
            chunk_bytes: int = CHUNK_BYTES, attn_implementation: str | None = None,
            trust_remote_code: bool = False) -> PreparedLoad:
    """Build on meta, then :func:`prepare_model` with the model's conversion mapping; a checkpoint that
    does not fit the model (missing or unexpected keys) is a :class:`CheckpointKeyError`. ``dtype`` and
    ``attn_implementation`` default to what ``from_pretrained`` gives: the checkpoint's dtype
    (:func:`checkpoint_dtype`) and transformers' attention choice."""
    t_start = time.perf_counter()
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise CheckpointKeyError(f"{model_dir}: no config.json; pass a transformers checkpoint directory")
    reader = Reader(model_dir, chunk_bytes)  # headers only: fail early on a directory without weights
    with quiet_transformers():
        config = load_config(model_dir, trust_remote_code)
    fmt = checkpoint_format(getattr(config, "quantization_config", None), str(model_dir))
    if fmt is not None:  # dequantised at load, as from_pretrained(..., dequantize=True) gives it
        reader = DequantizingReader(reader, fmt)
        del config.quantization_config
    dtype = dtype or checkpoint_dtype(config, reader)
    t0 = time.perf_counter()
    model = meta_model(config, dtype, attn_implementation)
    build_s = time.perf_counter() - t0
    loading = prepare_model(model, reader, plan, ep, artifact_dir, dtype, model_conversion_mapping(model))
    loading.timings["build_s"], loading.started = build_s, t_start
    loading.allowed_missing = _check_keys(model, loading.units, list(loading.unexpected), model_dir)
    return loading


def prepare_model(model: nn.Module, reader: Reader, plan, ep: ExpertParallelGroup, artifact_dir,
                  dtype: torch.dtype, transforms: list, device: torch.device | None = None) -> PreparedLoad:
    """On a model built on the meta device: find or write the artifact (rank 0 first), install the plan,
    map the checkpoint's keys with ``transforms`` (transformers' renamings and converters): everything
    before a tensor is read. ``device``: where the tensors are allocated (the CPU by default)."""
    from ..match import generate
    from . import install

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    # rank 0 finds or writes the artifact first; the others reuse it, no analysis
    artifact = rank0_first(lambda: generate.ensure_artifact(model, plan, model.config, Path(artifact_dir)))
    _release_freed_memory()  # the analysis ran random-weight copies of whole blocks: give that back first
    timings["analyze_s"] = time.perf_counter() - t_start

    t0 = time.perf_counter()
    patched = install.install(model, artifact, plan, ep, shard=True)  # on meta: local shapes, no storage
    experts = expert_slices(model)
    timings["install_s"] = time.perf_counter() - t0
    units, unexpected = map_keys(model, reader, transforms)
    filler = _Filler(model, reader, experts, _dtype_rule(model, dtype), device)
    return PreparedLoad(model, reader, filler, units, unexpected, transforms, experts, patched, ep, timings, t_start)


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
            f"not filled by the checkpoint nor initialised: {_list(sorted(set(left), key=natural_key))}"
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


def _bytes(model: nn.Module, experts: dict[str, ExpertSlice]) -> tuple[int, int]:
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
