"""The one place hp-rewrite talks to transformers, by topic (each module imports only those above it):

- :mod:`.logs`: silencing transformers (:func:`quiet_transformers`), its loggers, progress bar and
  loading report, errors cut to one line;
- :mod:`.config`: reading a config (:func:`load_config` for a checkpoint directory, :func:`auto_config`
  for any name or path), remote code, the router's top-k, transformers' version;
- :mod:`.checkpoints`: the weight conversions the loaders apply (:func:`core_model_loading`,
  :func:`model_conversion_mapping`), quantisers, the original format, shard sizes;
- :mod:`.models`: the class that builds a config's model (:func:`auto_class_for`) and building it
  (:func:`instantiate` from a class, :func:`meta_model` on the meta device, :func:`pretrained_model`
  with from_pretrained; :func:`pretrained_class_for` the class that loads a checkpoint).

Shrinking a config to a tiny one is :mod:`hp_rewrite.hf.shrink`. transformers is imported inside the
functions, never at import time. This package imports nothing of hp-rewrite but :mod:`hp_rewrite.errors`.
"""

from __future__ import annotations

from .checkpoints import (
    core_model_loading,
    deepspeed_zero3,
    dequantizing_config,
    initialization,
    last_checkpoint,
    loading_info,
    model_conversion_mapping,
    original_format,
    quant_method,
    save_remote_code,
    size_in_bytes,
    storage_key,
    stored_quantization_config,
    transformers_keeps,
    without_quantizer_transforms,
)
from .config import (
    auto_config,
    config_mapping,
    is_config,
    is_remote_config,
    load_config,
    remote_code_sha256,
    top_k_of,
    transformers_version,
)
from .logs import log_loading_report, progress_bar, quiet_transformers, short_error, transformers_logger
from .models import (
    auto_class_for,
    instantiate,
    meta_model,
    pretrained_class_for,
    pretrained_model,
    pretrained_model_class,
)

__all__ = [
    "auto_class_for",
    "auto_config",
    "config_mapping",
    "core_model_loading",
    "deepspeed_zero3",
    "dequantizing_config",
    "initialization",
    "instantiate",
    "is_config",
    "is_remote_config",
    "last_checkpoint",
    "load_config",
    "loading_info",
    "log_loading_report",
    "meta_model",
    "model_conversion_mapping",
    "original_format",
    "pretrained_class_for",
    "pretrained_model",
    "pretrained_model_class",
    "progress_bar",
    "quant_method",
    "quiet_transformers",
    "remote_code_sha256",
    "save_remote_code",
    "short_error",
    "size_in_bytes",
    "storage_key",
    "stored_quantization_config",
    "top_k_of",
    "transformers_keeps",
    "transformers_logger",
    "transformers_version",
    "without_quantizer_transforms",
]
