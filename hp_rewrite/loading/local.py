"""Load a checkpoint expert-parallel, reading only this rank's experts.

:func:`load_expert_parallel` builds the model on the meta device, analyses and installs the plan on
it (``keep_local_experts`` slices the meta parameters to the local expert count, so no storage exists
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
import functools
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from ..hf import (
    core_model_loading,
    load_config,
    meta_model,
    model_conversion_mapping,
    progress_bar,
    quiet_transformers,
)
from ..runtime import installed
from ..runtime.compute.quantized import QuantizedWeight
from ..runtime.group.groups import ExpertParallelGroup
from .checkpoint_files import (
    CHUNK_BYTES,
    CheckpointKeyError,
    ExpertSlice,
    LoadUnit,
    Reader,
    expert_slices,
    map_keys,
    natural_key,
    torch_dtype,
)
from .fill import Filler
from .initialise import ForeignExperts, initialise_missing, needs_exact_draws
from .quantized import DequantizingReader, checkpoint_format
from .rank0 import rank0_first

__all__ = ["CHUNK_BYTES", "CheckpointKeyError", "PreparedLoad", "load_expert_parallel", "prepare"]


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
        trainable = value.is_floating_point() and not isinstance(value, QuantizedWeight)  # kept codes: frozen
        value = nn.Parameter(value, requires_grad=old.requires_grad and trainable)
        module._parameters[attr] = value
    else:
        module._buffers[attr] = value
    return value


def _check_keys(
    model: nn.Module, units: dict[str, LoadUnit], unexpected: list[str], model_dir: Path,
    foreign_missing: set[str] = frozenset(), strict: bool = True,
) -> set[str]:
    """Raise on missing or unexpected keys (transformers' ignore rules apply; ``foreign_missing``: those of
    expert modules other ranks hold) when ``strict``; returns the missing ones, initialised or tied after."""
    produced = {t for u in units.values() for t in u.targets}
    expected = set(model.state_dict(keep_vars=True))
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    missing = (expected - produced) | set(foreign_missing)
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
    if strict and (real_missing or info.unexpected_keys):
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
        _finish(loading, new_for)
    loading.model.eval()
    return loading.model, loading.report()


@dataclass
class PreparedLoad:
    """A model built on the meta device with the plan installed (local expert shapes, no storage), and
    what maps the checkpoint onto it: the state between :func:`prepare` and filling the tensors."""

    model: nn.Module
    reader: Reader
    filler: Filler
    units: dict[str, LoadUnit]
    unexpected: dict[str, str]  # checkpoint keys no tensor of the model takes -> their renamed names
    transforms: list
    experts: dict[str, ExpertSlice]
    patched: list[str]
    ep: ExpertParallelGroup
    timings: dict[str, float]
    started: float
    allowed_missing: set[str] = field(default_factory=set)  # ignored or tied (checked by prepare)
    foreign_found: dict[str, str] = field(default_factory=dict)  # other ranks' expert modules' names -> keys

    @functools.cached_property
    def foreign(self) -> tuple[dict[str, ForeignExperts], set[str], set[tuple]]:
        """The containers of experts held as modules of which some live on other ranks (by path), with the
        absent experts' tensors the checkpoint lacks or (``ignore_mismatched_sizes``) mismatches, which the
        unmodified model draws; and its ``missing_keys`` and ``mismatched_keys`` entries for them."""
        out, missing, mismatched = {}, set(), set()
        for path, module in self.model.named_modules():
            layout = installed.layout(module)
            if installed.binding(module) is None or not layout.modules:
                continue
            absent = [k for k in layout.expert_keys if k not in set(layout.held)]
            if not absent:
                continue
            template = dict(module._modules[layout.held[0]].named_parameters())
            to_draw = set()
            for key in absent:
                for role, p in template.items():
                    name = f"{path}.{key}.{role}"
                    found = self.foreign_found.get(name)
                    if found is None:
                        missing.add(name)
                        to_draw.add(name)
                    elif not self.filler.fits_foreign(name, tuple(self.reader.infos[found].shape), tuple(p.shape)):
                        mismatched.add((name, torch.Size(self.reader.infos[found].shape), p.shape))
                        to_draw.add(name)
            out[path] = ForeignExperts(path, tuple(layout.expert_keys), tuple(layout.held), frozenset(to_draw))
        return out, missing, mismatched

    def initialise_missing(self) -> None:
        """transformers' ``initialize_weights``, with what the checkpoint lacks of the experts drawn as the
        unmodified model draws it (:mod:`.initialise`)."""
        foreign = self.foreign[0]
        if needs_exact_draws(self.model, self.experts, foreign):
            initialise_missing(self.model, self.experts, foreign, self.ep.size)
        else:
            type(self.model).initialize_weights(self.model)

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
        first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        for unit in progress_bar(self.ordered_units(), "Loading weights", shown=first):  # rank 0's, as transformers'
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
            trust_remote_code: bool = False, strict: bool = True) -> PreparedLoad:
    """Build on meta, then :func:`prepare_model` with the model's conversion mapping; a checkpoint that
    does not fit the model (missing or unexpected keys) is a :class:`CheckpointKeyError` when ``strict``
    (else the missing tensors are drawn, as ``from_pretrained`` draws them). ``dtype`` and
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
    loading.allowed_missing = _check_keys(model, loading.units, list(loading.unexpected), model_dir,
                                          loading.foreign[1], strict)
    return loading


def prepare_model(model: nn.Module, reader: Reader, plan, ep: ExpertParallelGroup, artifact_dir,
                  dtype: torch.dtype, transforms: list, device: torch.device | None = None,
                  ignore_mismatched_sizes: bool | None = None, keep_quantized: bool = False) -> PreparedLoad:
    """On a model built on the meta device: find or write the artifact (rank 0 first), install the plan,
    map the checkpoint's keys with ``transforms`` (transformers' renamings and converters): everything
    before a tensor is read. ``device``: where the tensors are allocated (the CPU by default);
    ``ignore_mismatched_sizes``: ``from_pretrained``'s (None outside it, see :class:`Filler`);
    ``keep_quantized``: the routed experts as the checkpoint's codes and scales (:mod:`.kept`)."""
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
    units, unexpected, foreign_found = map_keys(model, reader, transforms)
    filler = Filler(model, reader, experts, _dtype_rule(model, dtype), device, ignore_mismatched_sizes,
                    keep_quantized)
    return PreparedLoad(model, reader, filler, units, unexpected, transforms, experts, patched, ep, timings, t_start,
                        foreign_found=foreign_found)


def _finish(loading: PreparedLoad, new_for: dict[int, torch.Tensor]) -> None:
    """Meta tensors the checkpoint did not fill: shared ones, ties, then transformers' own init."""
    model, allowed_missing = loading.model, loading.allowed_missing
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
        loading.initialise_missing()  # only what no checkpoint tensor filled: non-persistent buffers, ignored keys
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
        size = t.stored_bytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
        if name in experts:
            expert += size
        else:
            other += size
    return expert, other
