"""Models from configs: the class that builds and reloads a config's model, building it (on the meta
device or not), loading it with from_pretrained.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

from ..errors import ModelDirError
from .checkpoints import dequantizing_config, quant_method
from .config import auto_config, is_config, is_remote_config
from .logs import quiet_transformers

# Auto classes in order of preference; the first whose mapping has the config class is used.
_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForImageTextToText",
    "AutoModelForMultimodalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModel",
    "AutoModelForTextToWaveform",
    "AutoModelForPreTraining",
    "AutoBackbone",
    "AutoModelForPoseEstimation",
)


# Auto classes whose mapped model class is returned instead of the Auto class itself.
_CONCRETE = frozenset({"AutoBackbone"})


def auto_class_for(config) -> type:
    """The class that builds and reloads the model of ``config``: an Auto class (causal LM first,
    then image-text-to-text, multimodal LM, seq2seq, base model, ...; for a backbone the model class
    it maps to), or, for a config type no Auto mapping lists (e.g. a sub-model's text config), the
    model class of its modeling module that declares it (``...ForCausalLM`` first, then
    ``...Model``). Both have ``from_pretrained``; build with :func:`instantiate`. Raises
    :class:`ModelDirError` when there is none."""
    import transformers

    auto_map = getattr(config, "auto_map", None) or {}  # remote code: the Auto classes its repository maps
    remote = next((name for name in _AUTO_CLASSES if name in auto_map and name not in _CONCRETE), None)
    if remote is not None:
        return getattr(transformers, remote)
    for name in _AUTO_CLASSES:
        auto = getattr(transformers, name, None)
        mapping = getattr(auto, "_model_mapping", None)
        if mapping is None:
            continue
        with contextlib.suppress(KeyError, ValueError, ImportError, AttributeError):
            model_class = mapping[type(config)]  # KeyError when not mapped; loads only this class
            # AutoBackbone.from_pretrained asks the Hub whether a local path is a repository
            return model_class if name in _CONCRETE else auto
    cls = _declared_model_class(config)
    if cls is None:
        raise ModelDirError(
            f"{config.model_type}: no Auto class and no model class declares {type(config).__name__}"
        )
    return cls


def _declared_model_class(config) -> type | None:
    from transformers import PreTrainedModel

    module_name = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    found = [
        obj
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, PreTrainedModel)
        and obj.__module__ == module.__name__
        and obj.config_class is type(config)
    ]

    def rank(cls: type) -> tuple[int, str]:
        name = cls.__name__
        order = ("ForCausalLM", "ForConditionalGeneration", "Model")
        return next((i for i, s in enumerate(order) if name.endswith(s)), len(order)), name

    found = [c for c in found if not c.__name__.endswith("PreTrainedModel")]
    return min(found, key=rank) if found else None


def instantiate(cls: type, config, dtype=None, attn_implementation: str | None = "eager"):
    """``cls`` (an Auto class or a model class) built from ``config`` with eager attention (None:
    transformers' choice, ``sdpa`` where the model has it), in ``dtype`` when given, on the current
    default device."""
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if is_remote_config(config) and hasattr(cls, "from_config"):  # trusted when its config was read
        kwargs["trust_remote_code"] = True
    build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    return build(config, **kwargs)


def meta_model(config, dtype=None, attn_implementation: str | None = "eager"):
    """The model of ``config`` on the meta device (structure only, no weights read or allocated),
    built with :func:`auto_class_for`'s class and eager attention (None: transformers' choice), in
    ``dtype`` when given. transformers' own errors pass through."""
    import torch

    cls = auto_class_for(config)
    with torch.device("meta"), quiet_transformers():
        return instantiate(cls, config, dtype, attn_implementation)


def pretrained_model(name_or_path, config=None, **kwargs):
    """``from_pretrained`` of :func:`auto_class_for`'s class (eager attention unless ``kwargs`` says
    otherwise; an MXFP4 / block-FP8 checkpoint dequantised); ``config`` is read from ``name_or_path``
    when not given."""
    config = config if config is not None else auto_config(
        name_or_path, **({"trust_remote_code": True} if kwargs.get("trust_remote_code") else {}))
    kwargs.setdefault("attn_implementation", "eager")
    if is_remote_config(config):
        kwargs["trust_remote_code"] = True
    method = quant_method(getattr(config, "quantization_config", None))
    if method in ("mxfp4", "fp8"):  # dequantised wherever it runs (what transformers does on a CPU)
        kwargs.setdefault("quantization_config", dequantizing_config(method))
    return auto_class_for(config).from_pretrained(name_or_path, **kwargs)


#: from_pretrained arguments that also locate the config
_CONFIG_KWARGS = ("trust_remote_code", "subfolder", "revision", "local_files_only", "token", "cache_dir")


def pretrained_class_for(name_or_path, config=None, **kwargs) -> type:
    """The class that loads ``name_or_path`` (:func:`auto_class_for` of its config, read with the
    ``from_pretrained`` arguments that locate it, or ``config`` when given)."""
    if config is None or not is_config(config):
        config = auto_config(config or name_or_path, **{k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs})
    return auto_class_for(config)


def pretrained_model_class() -> type:
    """transformers' ``PreTrainedModel`` (whose ``from_pretrained`` every model class ends in)."""
    from transformers import PreTrainedModel

    return PreTrainedModel
