"""Configs: reading a checkpoint's config (remote code only when trusted), its top-k, transformers'
config mapping and version.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

from ..errors import ModelDirError


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
