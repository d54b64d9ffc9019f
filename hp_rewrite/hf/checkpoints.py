"""Checkpoints as transformers reads and writes them: its weight conversions and quantisers, the
original format, shard sizes, loading reports, remote code beside the weights.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .logs import quiet_transformers


def core_model_loading() -> ModuleType:
    """``transformers.core_model_loading``: ``WeightRenaming``, ``WeightConverter``, their operations
    (``MergeModulelist``, ``Concatenate``...), ``rename_source_key``, ``apply_renamings``,
    ``build_glob_alternation``."""
    return importlib.import_module("transformers.core_model_loading")


def initialization() -> ModuleType:
    """``transformers.initialization``: the guarded init functions every ``_init_weights`` calls, and
    ``TORCH_INIT_FUNCTIONS``, the torch functions they end in."""
    return importlib.import_module("transformers.initialization")


def model_conversion_mapping(model) -> list:
    """The renamings and converters transformers applies when it loads ``model``'s checkpoints."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model)


def without_quantizer_transforms(model, weight_mapping: list, hf_quantizer) -> list:
    """``from_pretrained``'s weight mapping (the user's ``key_mapping`` renamings first, then the model's
    conversions as ``hf_quantizer`` rewrote them to read quantised tensors) with the model's own
    conversions in place of the quantiser's: for a reader that hands over dequantised tensors."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    quantized = get_model_conversion_mapping(model, None, hf_quantizer)
    user = list(weight_mapping)[: max(0, len(weight_mapping) - len(quantized))]  # key_mapping's renamings
    return user + get_model_conversion_mapping(model)


def stored_quantization_config(name_or_path, kwargs: dict):
    """The ``quantization_config`` of the checkpoint ``from_pretrained(name_or_path, **kwargs)`` would
    load (from ``config=`` when given), or None; a checkpoint transformers cannot resolve is left to it."""
    from transformers import PretrainedConfig

    config = kwargs.get("config")
    if isinstance(config, PretrainedConfig):
        return getattr(config, "quantization_config", None)
    where = {k: kwargs[k] for k in ("cache_dir", "force_download", "proxies", "token", "revision", "subfolder",
                                    "local_files_only") if k in kwargs}
    try:
        with quiet_transformers():
            config_dict, _ = PretrainedConfig.get_config_dict(name_or_path, **where)
    except Exception:  # noqa: BLE001 (transformers reports it in the call itself)
        return None
    return config_dict.get("quantization_config")


def quant_method(quantization_config) -> str | None:
    """The ``quant_method`` of a quantisation config: a dict as ``config.json`` holds it, or transformers'
    config object (whose method is a ``QuantizationMethod`` enum); None without one."""
    if quantization_config is None:
        return None
    method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) \
        else getattr(quantization_config, "quant_method", None)
    return str(getattr(method, "value", method) or "")


def dequantizing_config(method: str):
    """transformers' quantisation config asking ``from_pretrained`` to dequantise ``method`` checkpoints
    (only its loading attribute counts: transformers keeps the checkpoint's other fields)."""
    from transformers import FineGrainedFP8Config, Mxfp4Config

    return Mxfp4Config(dequantize=True) if method == "mxfp4" else FineGrainedFP8Config(dequantize=True)


def transformers_keeps(stored) -> bool:
    """Whether plain ``from_pretrained`` keeps a pre-quantised MXFP4 / FP8 checkpoint quantised on this
    machine (``stored``: its ``quantization_config``): transformers' own quantiser decides, on a copy."""
    import torch
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    if quant_method(stored) == "mxfp4" and not (torch.cuda.is_available() or torch.xpu.is_available()):
        return False  # on a CPU transformers dequantises MXFP4 unless use_kernels (before its weight loading)
    try:
        config = AutoQuantizationConfig.from_dict(dict(stored) if isinstance(stored, dict) else stored.to_dict())
        quantizer = AutoHfQuantizer.from_config(config, pre_quantized=True)
        with quiet_transformers():
            quantizer.validate_environment(device_map=None, weights_only=True, dtype=None)
    except Exception:  # noqa: BLE001 (what transformers refuses, it refuses in the call itself)
        return False
    return not getattr(config, "dequantize", True)


def original_format(model, tensors: dict) -> dict:
    """``tensors`` (in-memory names) under the names and layout of the checkpoint format the model was
    loaded from, as ``save_pretrained(save_original_format=True)`` writes them (per-expert keys...)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def save_remote_code(model, folder) -> None:
    """Copy a trust_remote_code model's code files into ``folder`` with its ``auto_map``, as
    ``save_pretrained`` does (nothing for a model of transformers itself)."""
    from transformers.dynamic_module_utils import custom_object_save

    if getattr(model, "is_remote_code", lambda: False)():
        custom_object_save(model, folder, config=model.config)


def size_in_bytes(size: int | str) -> int:
    """``max_shard_size`` as ``save_pretrained`` reads it: an int, or a string such as ``"50GB"``."""
    from huggingface_hub.serialization._base import parse_size_to_int

    return size if isinstance(size, int) else parse_size_to_int(size)


def storage_key(tensor) -> tuple[object, int]:
    """``(identity, bytes)`` of a tensor's storage as ``save_pretrained`` sizes shards: views of one
    storage share the identity and count its whole size once."""
    from huggingface_hub.serialization._torch import get_torch_storage_id, get_torch_storage_size

    return get_torch_storage_id(tensor), get_torch_storage_size(tensor)


def loading_info(missing: set[str], unexpected: set[str], mismatched: set[tuple] = frozenset()):
    """transformers' loading report (``LoadStateDictInfo``) for weights read outside its loader;
    ``mismatched``: ``(name, checkpoint shape, model shape)`` of the tensors left to re-initialise."""
    from transformers.utils.loading_report import LoadStateDictInfo

    return LoadStateDictInfo(missing_keys=set(missing), unexpected_keys=set(unexpected), mismatched_keys=set(mismatched),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())


def deepspeed_zero3() -> bool:
    """Whether transformers sees DeepSpeed ZeRO-3 enabled (it then loads the weights itself)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def last_checkpoint(output_dir) -> str | None:
    """The newest ``checkpoint-N`` directory under a Trainer's ``output_dir`` (None if there is none)."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir)
