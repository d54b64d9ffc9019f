"""``from_pretrained`` as transformers runs it, with only this rank's experts read.

transformers resolves everything a user passes (the class called or the one an Auto class picks,
``config=``, ``dtype`` with its ``"auto"`` default, ``attn_implementation``, ``key_mapping``,
``subfolder``, ``revision``, ``trust_remote_code``...), builds the model on the meta device and then
calls ``_load_pretrained_model(model, state_dict, checkpoint_files, load_config)`` to read the weights.
For the length of one call, :func:`load_rewritten` puts :class:`LocalExpertsLoad` in that place: on the
meta model it installs the plan (local expert shapes) and reads the checkpoint files transformers
resolved, only this rank's experts among them, with transformers' own renamings and converters
(:func:`hp_rewrite.loading.local.prepare_model`). It returns transformers' loading report, so the rest
of ``from_pretrained`` (missing weights initialised, ties, the report logged, generation config,
``output_loading_info``) runs unchanged.

An MXFP4 or block-FP8 checkpoint is read the same way, dequantised by rank
(:mod:`hp_rewrite.loading.quantized`): :func:`dequantize_at_load` asks transformers for
``dequantize=True`` before the call, and the quantiser's conversions give way to the model's own
over a reader that hands over dequantised tensors. Any other quantisation is refused.
Where only-local reading cannot apply (a ``state_dict``, ``.bin`` checkpoints, DeepSpeed ZeRO-3),
transformers reads the whole model, a warning says why, and the experts are sharded after.
Options that would place one rank's experts elsewhere (a ``device_map`` over several devices, a
transformers ``tp_plan`` / ``distributed_config``) are refused by name.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..hf import (
    deepspeed_zero3,
    dequantizing_config,
    loading_info,
    pretrained_model_class,
    stored_quantization_config,
    transformers_keeps,
    without_quantizer_transforms,
)
from ..runtime.errors import ExpertParallelError
from ..runtime.group.groups import ExpertParallelGroup
from .checkpoint_files import Reader
from .quantized import DequantizingReader, QuantizedCheckpointError, checkpoint_format


class LocalExpertsLoad:
    """transformers' ``_load_pretrained_model`` for one ``from_pretrained`` call (its first use only:
    an adapter loaded afterwards goes through transformers' own)."""

    def __init__(self, plan, ep: ExpertParallelGroup, artifact_dir: Path, original: Callable,
                 keep_quantized: bool = False) -> None:
        self.plan, self.ep, self.artifact_dir, self.original = plan, ep, artifact_dir, original
        self.keep_quantized = keep_quantized  # the routed experts as codes and scales (:mod:`.kept`)
        self.loading = None  # the PreparedLoad, once the weights were read here
        self.whole_model: str | None = None  # why transformers read the whole model instead
        self.used = False

    def __call__(self, model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        if self.used:
            return self.original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        self.used = True
        device = _single_device(load_config)
        self.whole_model = _why_whole_model(state_dict, checkpoint_files, load_config)
        if self.whole_model is not None:
            if self.keep_quantized:
                raise QuantizedCheckpointError(
                    f"the experts cannot be kept quantised here: {self.whole_model}, so transformers would read "
                    "and dequantise the whole model; load a safetensors checkpoint from its directory, or pass "
                    "dequantize=True")
            return self.original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        from .local import prepare_model

        reader = Reader(None, files=[Path(f) for f in checkpoint_files])
        transforms = list(load_config.weight_mapping or [])
        quantizer = load_config.hf_quantizer
        if quantizer is not None:  # MXFP4 / block FP8 dequantised (refused otherwise): read as the plain tensors
            reader = DequantizingReader(reader, dequantized_format(quantizer))
            transforms = without_quantizer_transforms(model, transforms, quantizer)
        loading = prepare_model(model, reader, self.plan, self.ep, self.artifact_dir, load_config.dtype,
                                transforms, device, bool(load_config.ignore_mismatched_sizes),
                                keep_quantized=self.keep_quantized and quantizer is not None)
        loading.fill()
        self.loading = loading
        foreign, foreign_missing, foreign_mismatched = loading.foreign
        missing, mismatched = loading.missing | foreign_missing, loading.filler.mismatched | foreign_mismatched
        if loading.filler.keep_quantized:
            _refuse_drawn_quantized(loading, missing | {name for name, _, _ in mismatched})
        # missing and mismatched tensors stay on meta: transformers materialises, initialises (here as the
        # unmodified model draws them, :mod:`.initialise`) and reports them, other ranks' expert modules too
        absent = set().union(*(f.to_draw for f in foreign.values()))
        model.initialize_weights = loading.initialise_missing
        model._move_missing_keys_from_meta_to_device = functools.partial(_move_held_from_meta, model, absent)
        model.mark_tied_weights_as_initialized = functools.partial(_mark_tied_held, model, absent)
        return loading_info(missing, set(loading.unexpected.values()), mismatched), None


def _move_held_from_meta(model, absent: set[str], missing_keys, *args, **kwargs) -> None:
    """transformers' step, for the tensors this rank holds (other ranks' expert modules, ``absent``, are
    drawn on copies, :mod:`.initialise`)."""
    type(model)._move_missing_keys_from_meta_to_device(model, set(missing_keys) - absent, *args, **kwargs)


def _mark_tied_held(model, absent: set[str], info) -> None:
    """transformers' step on the tensors this rank holds; ``absent`` ones stay missing (never tied)."""
    gone = info.missing_keys & absent
    info.missing_keys -= gone
    try:
        type(model).mark_tied_weights_as_initialized(model, info)
    finally:
        info.missing_keys |= gone


#: the per-call stand-ins :class:`LocalExpertsLoad` sets on the model it loads, removed when the call returns
_DURING_LOAD = ("initialize_weights", "_move_missing_keys_from_meta_to_device", "mark_tied_weights_as_initialized")


def _refuse_drawn_quantized(loading, drawn: set[str]) -> None:
    """Experts kept quantised cannot be drawn: the codes come from the checkpoint."""
    experts = sorted(n for n in drawn if n in loading.experts)
    if experts:
        raise QuantizedCheckpointError(
            f"{experts[0]} is not in the checkpoint (or mismatches it; {len(experts)} expert tensor(s) in all), and "
            "the routed experts are kept quantised, as the checkpoint's codes: there is nothing to keep. Pass "
            "quantization_config=...(dequantize=True) to load them dequantised (the missing ones then drawn as "
            "transformers draws them), or load a checkpoint that holds them")


def _single_device(load_config) -> torch.device | None:
    """The one device of ``device_map`` (None without one); several devices or disk are refused."""
    device_map = load_config.device_map
    if not device_map:
        return None
    devices = set(device_map.values())
    if len(devices) > 1 or "disk" in devices:
        raise ExpertParallelError(
            f"from_pretrained(device_map=...) places the model on {sorted(map(str, devices))}: an expert-parallel "
            "rank keeps its experts and every other weight on one device; pass device_map=<that device> (or none)"
        )
    device = next(iter(devices))
    return torch.device(device if not isinstance(device, int) else f"cuda:{device}")


def _why_whole_model(state_dict, checkpoint_files, load_config) -> str | None:
    """Why only-local reading cannot take this load (None when it can)."""
    if load_config.device_mesh is not None:
        raise ExpertParallelError(
            "from_pretrained(tp_plan=... / distributed_config=...): transformers' own tensor or expert "
            "parallelism would shard the weights the plan shards; drop it and set ep_size in the plan"
        )
    if state_dict is not None:
        return "from_pretrained(state_dict=...) hands over tensors already in memory"
    if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return "the checkpoint is not in safetensors files (only those can be read a rank's experts at a time)"
    if deepspeed_zero3():
        return "DeepSpeed ZeRO-3 is enabled: it loads the weights itself"
    return None


def dequantize_at_load(name_or_path, kwargs: dict) -> tuple[dict, bool]:
    """``from_pretrained``'s ``kwargs`` for an expert-parallel load, and whether the experts stay quantised.

    transformers is always asked for ``dequantize=True`` (the plain model's modules, each rank reading and
    dequantising its own experts). The routed experts are kept as the checkpoint's codes and scales
    (:mod:`.kept`) where the user asked to keep them (``Mxfp4Config(dequantize=False)``,
    ``FineGrainedFP8Config(dequantize=False)``) or, with no config passed, where transformers itself would
    keep the checkpoint quantised on this machine. Every other quantisation is refused before anything is read."""
    passed = kwargs.get("quantization_config")
    stored = stored_quantization_config(name_or_path, kwargs)
    if passed is not None:
        if isinstance(passed, dict):
            raise QuantizedCheckpointError(
                "from_pretrained(quantization_config={...}): pass transformers' config object "
                "(Mxfp4Config(dequantize=...) / FineGrainedFP8Config(dequantize=...)) or none"
            )
        if stored is None:
            raise _quantising_at_load(passed)
        fmt = checkpoint_format(passed, "from_pretrained(quantization_config=...)")
        if getattr(passed, "dequantize", False):
            return kwargs, False
        return {**kwargs, "quantization_config": dequantizing_config(fmt.method)}, True
    fmt = checkpoint_format(stored, str(name_or_path))
    if fmt is None:
        return kwargs, False
    keep = transformers_keeps(stored)
    if keep:  # as plain transformers here; say it, since it changes what trains
        warnings.warn(
            f"hp-rewrite: {name_or_path} is {fmt.describe()}, which transformers keeps quantised on this machine: the "
            "routed experts stay as its codes and load frozen (LoRA on them trains); to train them in full, pass "
            f"quantization_config={type(dequantizing_config(fmt.method)).__name__}(dequantize=True)", stacklevel=3)
    return {**kwargs, "quantization_config": dequantizing_config(fmt.method)}, keep


def dequantized_format(quantizer):
    """The format transformers' quantiser reads, when it dequantises a pre-quantised MXFP4 / FP8
    checkpoint (what hp-rewrite reads by rank); anything else is refused."""
    qc = quantizer.quantization_config
    if not quantizer.pre_quantized:
        raise _quantising_at_load(qc)
    fmt = checkpoint_format(qc, "the quantization_config")
    if not getattr(qc, "dequantize", False):  # dequantize_at_load asked for it: a call that bypassed it
        raise QuantizedCheckpointError(
            f"{fmt.describe()} with {type(qc).__name__}(dequantize=False) reached the loader without "
            "hp-rewrite's from_pretrained: load through hp_rewrite.from_pretrained or auto_patch")
    return fmt


def _quantising_at_load(qc) -> QuantizedCheckpointError:
    return QuantizedCheckpointError(
        f"from_pretrained(quantization_config={type(qc).__name__}(...)) on an unquantised checkpoint quantises it "
        "at load: the expert-parallel experts run as bf16/fp32 grouped GEMMs; load it without a quantization_config"
    )


def load_rewritten(call: Callable[[], object], plan, ep: ExpertParallelGroup, artifact_dir: Path,
                   rewrite: Callable, attach: Callable, keep_quantized: bool = False):
    """Run ``call`` (a ``from_pretrained``) with :class:`LocalExpertsLoad` in place, and return its result
    with the model rewritten: installed and read by rank while loading, or (the whole-model case, with a
    warning) rewritten after by ``rewrite(model)``. ``attach(model, loading)`` marks a model loaded here.
    A call inside another one (``hp_rewrite.from_pretrained`` under ``auto_patch``) is left to the outer."""
    owner = pretrained_model_class()
    original = owner.__dict__["_load_pretrained_model"]
    if isinstance(original.__func__, LocalExpertsLoad):
        return call()
    hook = LocalExpertsLoad(plan, ep, artifact_dir, original.__func__, keep_quantized)
    owner._load_pretrained_model = staticmethod(hook)
    try:
        result = call()
    finally:
        owner._load_pretrained_model = original
        for name in _DURING_LOAD if hook.loading is not None else ():
            hook.loading.model.__dict__.pop(name, None)
    model = result[0] if isinstance(result, tuple) else result
    if hook.loading is not None:
        attach(model, hook.loading)
    else:
        if hook.whole_model is not None:
            warnings.warn(f"hp-rewrite: transformers read the whole model on every rank ({hook.whole_model}); "
                          "its experts are sharded after loading", stacklevel=3)
        rewrite(model)
    return result
