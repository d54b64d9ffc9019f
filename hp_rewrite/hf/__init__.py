"""The one place hp-rewrite talks to transformers.

Everything the other layers need from transformers goes through here: reading a config
(:func:`load_config` for a checkpoint directory, :func:`auto_config` for any name or path), the
class that builds a config's model (:func:`auto_class_for`), building it (:func:`instantiate`,
:func:`meta_model`, :func:`build_meta_model`, :func:`pretrained_model`), silencing its logs
(:func:`quiet_transformers`), the weight conversion mapping the loaders apply
(:func:`core_model_loading`, :func:`model_conversion_mapping`), and its version. Shrinking a config
to a tiny one is :mod:`hp_rewrite.hf.shrink`.

transformers is imported inside the functions, never at import time. This package imports nothing
of hp-rewrite but :mod:`hp_rewrite.errors`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from ..errors import ModelDirError

__all__ = [
    "auto_class_for",
    "auto_config",
    "build_meta_model",
    "config_mapping",
    "core_model_loading",
    "deepspeed_zero3",
    "dequantizing_config",
    "instantiate",
    "is_config",
    "last_checkpoint",
    "load_config",
    "loading_info",
    "meta_model",
    "model_conversion_mapping",
    "original_format",
    "pretrained_class_for",
    "pretrained_model",
    "pretrained_model_class",
    "quant_method",
    "quiet_transformers",
    "save_remote_code",
    "short_error",
    "size_in_bytes",
    "stored_quantization_config",
    "transformers_keeps",
    "storage_key",
    "top_k_of",
    "progress_bar",
    "transformers_logger",
    "transformers_version",
    "without_quantizer_transforms",
]


# ----------------------------------------------------------------------------------------------
# small helpers


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings and progress bars (config validation chatter, shard bars)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def progress_bar(items, desc: str, shown: bool = True):
    """``items`` under transformers' progress bar (off where transformers' bars are off), shown or not."""
    from transformers.utils import logging as hf_logging

    return hf_logging.tqdm(items, desc=desc, disable=not shown)


def transformers_logger(module: str):
    """The logger of ``transformers.<module>``, to report what transformers reports there, as it does."""
    from transformers.utils import logging as hf_logging

    return hf_logging.get_logger(f"transformers.{module}")


def short_error(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters (transformers errors can be long)."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: Config fields that hold the router's top-k, in order of preference.
_TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token")


def top_k_of(block, router, *configs) -> int | None:
    """The router's top-k: an integer ``top_k`` on ``router``, else on ``block``, else a top-k field
    (:data:`_TOP_K_FIELDS`) of each config given (its decoder text config), in order; None if none."""
    for owner in (router, block):
        k = _int(getattr(owner, "top_k", None)) if owner is not None else None
        if k is not None:
            return k
    for config in configs:
        if config is None:
            continue
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        for name in _TOP_K_FIELDS:
            k = _int(getattr(text, name, None))
            if k is not None:
                return k
    return None


def transformers_version() -> str:
    import transformers

    return transformers.__version__


# ----------------------------------------------------------------------------------------------
# configs


def load_config(model_dir: Path, trust_remote_code: bool = False):
    """The config of a checkpoint directory; :class:`ModelDirError` when it has no readable config.json,
    or when it is remote code (an ``auto_map``) and ``trust_remote_code`` is not given."""
    import json

    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelDirError(
            f"{model_dir}: no config.json; pass a transformers checkpoint directory "
            "(hp-rewrite make-tiny MODEL_TYPE DIR writes a small one)"
        )
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        auto_map = None
        with contextlib.suppress(OSError, ValueError):
            auto_map = json.loads((model_dir / "config.json").read_text()).get("auto_map")
        if auto_map and not trust_remote_code:
            files = sorted({str(v).split(".")[0] for v in auto_map.values() if isinstance(v, str)})
            raise ModelDirError(
                f"{model_dir} is a remote-code model (its config.json maps its classes to "
                f"{', '.join(f + '.py' for f in files)}): read that code, then pass --trust-remote-code "
                "(trust_remote_code=True in Python) to run it") from e
        raise ModelDirError(f"{model_dir}/config.json: transformers cannot read it: {e}") from e


def is_remote_config(config) -> bool:
    """Whether ``config`` comes from remote code (its class imported from the checkpoint's own files,
    with ``trust_remote_code=True``): building its model needs the same trust, already given."""
    return type(config).__module__.startswith("transformers_modules.")


def remote_code_sha256(config) -> str | None:
    """A hash of every Python file beside the remote code ``config``'s class came from (the copy
    transformers imported, in its modules cache); None for a config of transformers itself."""
    import hashlib

    if not is_remote_config(config):
        return None
    folder = Path(inspect.getsourcefile(type(config))).parent
    digest = hashlib.sha256()
    for f in sorted(folder.glob("*.py")):
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


def auto_config(name_or_path, **kwargs):
    """``AutoConfig.from_pretrained`` as is (a hub id or a path; transformers' own errors)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name_or_path, **kwargs)


def config_mapping():
    """transformers' ``CONFIG_MAPPING``: model type name -> config class."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING


def is_config(value) -> bool:
    from transformers import PreTrainedConfig

    return isinstance(value, PreTrainedConfig)


# ----------------------------------------------------------------------------------------------
# model classes and building

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
    ``dtype`` when given."""
    import torch

    cls = auto_class_for(config)
    with torch.device("meta"), quiet_transformers():
        return instantiate(cls, config, dtype, attn_implementation)


def build_meta_model(config):
    """``(model, note)``: :func:`meta_model`; for a config whose Auto class rejects it ("Unrecognized
    configuration class"), the model class its modeling module declares, built directly, with a note
    saying so (else ``note`` is None). Raises :class:`ModelDirError` when neither builds."""
    import torch

    try:
        return meta_model(config), None
    except Exception as first:  # noqa: BLE001 - transformers raises many kinds here
        try:
            cls = auto_class_for(config)
        except ModelDirError:
            cls = None
        if cls is None or "Unrecognized configuration class" not in str(first):
            raise ModelDirError(
                f"transformers cannot build the model from this config ({short_error(first)}); "
                "fix the config (or report it upstream) and retry"
            ) from first
        try:
            with torch.device("meta"):
                model = instantiate(cls, config)
        except Exception as e:  # noqa: BLE001
            raise ModelDirError(
                f"transformers cannot build the model from this config: AutoModelForCausalLM / AutoModel do "
                f"not take it, and {cls.__name__} raised {short_error(e)}; fix the config (or report it "
                "upstream) and retry"
            ) from e
        note = (
            f"described from {type(model).__name__}, built directly: `hp-rewrite apply` builds models with "
            f"AutoModelForCausalLM / AutoModel, which cannot build this config ({short_error(first, 160)})"
        )
        return model, note


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


# ----------------------------------------------------------------------------------------------
# checkpoints


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


def log_loading_report(model, name_or_path, info) -> None:
    """transformers' LOAD REPORT of ``from_pretrained`` (missing, unexpected, mismatched keys), as it logs it."""
    from transformers.utils.loading_report import log_state_dict_report

    log_state_dict_report(model=model, pretrained_model_name_or_path=str(name_or_path), ignore_mismatched_sizes=False,
                          loading_info=info, logger=transformers_logger("modeling_utils"))


def deepspeed_zero3() -> bool:
    """Whether transformers sees DeepSpeed ZeRO-3 enabled (it then loads the weights itself)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def last_checkpoint(output_dir) -> str | None:
    """The newest ``checkpoint-N`` directory under a Trainer's ``output_dir`` (None if there is none)."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir)
