"""Filling a meta model's tensors from a checkpoint, one load unit at a time.

:class:`Filler` reads a :class:`LoadUnit` (a tensor stored under its name or a renaming of it, per-expert
tensors merged in place, or any transformers converter on lazily read tensors) into fresh tensors of
the model's local shapes: only this rank's expert rows are read. It also decides what a checkpoint
tensor of another shape than the model's means: an error, or (``from_pretrained(ignore_mismatched_sizes=
True)``) a mismatch recorded as transformers records it. Used by :mod:`hp_rewrite.loading.local`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..hf import core_model_loading
from ..runtime.errors import ExpertParallelError
from .checkpoint_files import (
    CheckpointKeyError,
    CheckpointShapeError,
    ExpertSlice,
    LoadUnit,
    Reader,
    index_regex,
)
from .kept import kept_expert

__all__ = ["Filler"]


def _op_dims(op) -> list[int]:
    return [getattr(op, a) for a in ("dim", "dim0", "dim1") if isinstance(getattr(op, a, None), int)]


def _is_merge(op) -> bool:
    return isinstance(op, core_model_loading().MergeModulelist) and op.dim == 0


def _is_concat(op) -> bool:
    return isinstance(op, core_model_loading().Concatenate) and op.dim >= 1


class Filler:
    """Reads load units into fresh tensors. A checkpoint tensor of another shape than the model's is a
    :class:`CheckpointShapeError`, unless ``ignore_mismatched_sizes`` (``from_pretrained``'s; None outside
    it): then it is recorded in ``mismatched`` as transformers records it, ``(name, checkpoint shape, model
    shape)`` with every expert counted, and left unfilled for transformers to initialise."""

    def __init__(self, model: nn.Module, reader: Reader, experts: dict[str, ExpertSlice], dtypes: Callable,
                 device: torch.device | None = None, ignore_mismatched_sizes: bool | None = None,
                 keep_quantized: bool = False) -> None:
        self.model, self.reader, self.experts, self.dtype_for = model, reader, experts, dtypes
        self.keep_quantized = keep_quantized  # expert weights as codes and scales (:mod:`.kept`)
        self.device, self.ignore_mismatched_sizes = device, ignore_mismatched_sizes
        self.mismatched: set[tuple[str, torch.Size, torch.Size]] = set()
        self.meta = model.state_dict(keep_vars=True)
        self.paths = {"tensor": 0, "merged_experts": 0, "transformers_converter": 0, "kept_quantized": 0}

    def empty(self, name: str) -> torch.Tensor:
        return torch.empty(self.meta[name].shape, dtype=self.dtype_for(name), device=self.device)

    def fill(self, unit: LoadUnit) -> dict[str, torch.Tensor]:
        """The unit's tensors by name; a mismatched one (recorded) is left out."""
        if self.keep_quantized and unit.targets[0] in self.experts:
            kept = kept_expert(self, unit, unit.targets[0], self.experts[unit.targets[0]])
            if kept is not None:
                self.paths["kept_quantized"] += 1
                return {unit.targets[0]: kept}
        if unit.key is not None:
            self.paths["tensor"] += 1
            return _present({unit.targets[0]: self._plain(unit.targets[0], unit.key)})
        ops = list(unit.converter.operations)
        patterns = unit.converter.source_patterns
        per_expert = any(index_regex(p) is not None for p in unit.sources)
        if per_expert and len(unit.targets) == 1 and all(index_regex(p) for p in patterns):
            if len(ops) == 1 and len(patterns) == 1 and _is_merge(ops[0]):
                self.paths["merged_experts"] += 1
                return _present({unit.targets[0]: self._merge(unit, None)})
            if len(ops) == 2 and _is_merge(ops[0]) and _is_concat(ops[1]):
                self.paths["merged_experts"] += 1
                return _present({unit.targets[0]: self._merge(unit, ops[1].dim)})
        self.paths["transformers_converter"] += 1
        return self._convert(unit, per_expert)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The model's shape of ``name`` with every expert (the unmodified model's)."""
        shape, sl = tuple(self.meta[name].shape), self.experts.get(name)
        return shape if sl is None else (sl.full_dim0, *shape[1:])

    def _fits(self, name: str, shape: tuple[int, ...], what: str, local: bool = False) -> bool:
        """Whether ``shape`` (the checkpoint's, every expert; this rank's rows when ``local``) is the
        model's; a mismatch raises, or is recorded (full shapes, as the unmodified model's) when
        ``ignore_mismatched_sizes`` asked for that: transformers then draws the tensor, at any ep_size
        as the unmodified model does (:mod:`.initialise`)."""
        want = tuple(self.meta[name].shape) if local else self.full_shape(name)
        if tuple(shape) == want:
            return True
        self._mismatch(name, shape, want, what)
        if local and (sl := self.experts.get(name)) is not None:  # as the unmodified model reports it
            shape, want = (sl.full_dim0, *tuple(shape)[1:]), self.full_shape(name)
        self.mismatched.add((name, torch.Size(shape), torch.Size(want)))
        return False

    def fits_foreign(self, name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
        """:meth:`_fits` for a tensor of an expert module another rank holds (never read here)."""
        if tuple(shape) == tuple(want):
            return True
        self._mismatch(name, shape, want, "the checkpoint")
        return False

    def _mismatch(self, name: str, shape, want, what: str) -> None:
        """Raise unless ``ignore_mismatched_sizes`` asked to re-initialise the tensor."""
        message = f"{what} gives {name} the shape {list(shape)}, the model expects {list(want)}"
        if self.ignore_mismatched_sizes is False:  # from_pretrained: transformers' remedy
            message += "; from_pretrained(..., ignore_mismatched_sizes=True) re-initialises it as transformers does"
        if not self.ignore_mismatched_sizes:
            raise CheckpointShapeError(message)

    def _plain(self, name: str, key: str) -> torch.Tensor | None:
        if not self._fits(name, self.reader.infos[key].shape, f"checkpoint tensor {key}"):
            return None
        out = self.empty(name)
        sl = self.experts.get(name)
        if sl is None:
            self.reader.copy_into(key, out)
            return out
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
                raise CheckpointShapeError(
                    f"{name}: checkpoint keys {pattern!r} hold experts {_ranges(indices)}; "
                    + (f"missing {_ranges(missing)}" if missing else "")
                    + (f" unexpected {_ranges(extra)}" if extra else "")
                    + f" (expected 0..{len(expected) - 1})"
                )
            keep = set(sl.experts) if sl else range(len(items))
            out[pattern] = sorted((i, k) for i, k in items if i in keep)
        return out

    def _stacked_shape(self, unit: LoadUnit, cat_dim: int | None) -> tuple[int, ...]:
        """The shape transformers' ``MergeModulelist(0)`` [+ ``Concatenate(cat_dim)``] gives the checkpoint's
        per-expert tensors (every expert); tensors it could not stack or concatenate raise."""
        held = {p: {i for i, _ in unit.sources.get(p, []) if i is not None} for p in unit.converter.source_patterns}
        every = set().union(*held.values())
        for pattern, indices in held.items():
            if indices and indices != every:
                raise CheckpointShapeError(
                    f"{unit.targets[0]}: checkpoint keys {pattern!r} hold experts {_ranges(sorted(indices))}; "
                    f"missing {_ranges(sorted(every - indices))}, which the other tensors of the expert hold"
                )
        stacked = []
        for pattern in unit.converter.source_patterns:
            keys = [k for _, k in unit.sources.get(pattern, [])]
            shapes = sorted({tuple(self.reader.infos[k].shape) for k in keys})
            if len(shapes) > 1:
                raise CheckpointShapeError(f"{unit.targets[0]}: the checkpoint's {pattern!r} tensors differ in shape "
                                           f"({', '.join(map(str, map(list, shapes)))}); they cannot be stacked")
            if keys:
                stacked.append((len(keys), *shapes[0]))
        if not stacked:
            raise CheckpointKeyError(f"{unit.targets[0]}: no checkpoint tensor for {unit.converter.source_patterns}")
        if cat_dim is None or len(stacked) == 1:
            return stacked[0]
        def beside(shape: tuple[int, ...]) -> tuple[int, ...]:  # every dimension but the concatenated one
            return shape[:cat_dim] + shape[cat_dim + 1:]

        if any(len(s) != len(stacked[0]) or beside(s) != beside(stacked[0]) for s in stacked):
            raise CheckpointShapeError(
                f"{unit.targets[0]}: the checkpoint's {' + '.join(unit.converter.source_patterns)} "
                f"({', '.join(str(list(s)) for s in stacked)}) cannot be concatenated along dim {cat_dim}"
            )
        return (*stacked[0][:cat_dim], sum(s[cat_dim] for s in stacked), *stacked[0][cat_dim + 1:])

    def _merge(self, unit: LoadUnit, cat_dim: int | None) -> torch.Tensor | None:
        """``MergeModulelist(0)`` [+ ``Concatenate(d)``] written straight into the (local) parameter."""
        name = unit.targets[0]
        indices = sorted({i for items in unit.sources.values() for i, _ in items if i is not None})
        what = f"the checkpoint's {' + '.join(unit.converter.source_patterns)} (experts {_ranges(indices)})"
        if not self._fits(name, self._stacked_shape(unit, cat_dim), what):
            return None
        local = self._local(unit, name)
        out = self.empty(name)
        offset = 0
        for pattern in unit.converter.source_patterns:
            items = local[pattern]
            if not items:
                continue
            width = self.reader.infos[items[0][1]].shape[cat_dim - 1] if cat_dim is not None else None
            for j, (_, key) in enumerate(items):
                slot = out[j] if cat_dim is None else out[j].narrow(cat_dim - 1, offset, width)
                self.reader.copy_into(key, slot)
            offset += width or 0
        return out

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
                        if (not shape or shape[0] != sl.full_dim0) and not self._fits(
                                name, shape, f"checkpoint tensor {key}"):
                            return {}  # recorded as mismatched: drawn by transformers, as the unmodified model
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
            if not self._fits(target, tuple(value.shape), f"the conversion {unit.converter!r}", local=partial):
                continue
            dest = self.empty(target)
            dest.copy_(value)
            out[target] = dest
        return out


def _present(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if t is not None}


def _lazy(reader: Reader, key: str, rows: list[tuple[int, int]] | None) -> Callable[[], torch.Tensor]:
    return lambda: reader.read(key, rows)


def _ranges(values: list[int]) -> str:
    """Sorted integers as compact ranges: ``0-3,5``."""
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
