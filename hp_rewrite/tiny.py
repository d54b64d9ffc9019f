"""Tiny random-weight transformers models, built from config classes only (nothing is downloaded).

Shipped for ``hp-rewrite make-tiny`` and used by the tests and tools. The config is shrunk by
:func:`hp_rewrite.hf.shrink.tiny_config`; ``build_tiny_model`` builds the model with the right class
(:func:`hp_rewrite.hf.auto_class_for`), in fp32, ``eval()``, with eager attention, fills expert
weights its ``_init_weights`` leaves uninitialised (:func:`fill_uninitialised_experts`), and randomises
router weights, router biases and selection-bias buffers (:func:`randomise_routers`; transformers
initialises several to zeros, which makes routing degenerate). ``make_tiny`` writes a real
checkpoint (``config.json`` + ``model.safetensors``) atomically. ``moe_model_types`` finds, by
structure, every model type of the installed transformers whose tiny model holds experts
(:func:`hp_rewrite.match.structure.find_experts_holders` with ``any_layout``: the one experts-holder
detector). Nothing is cached between calls.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import ModelDirError
from .hf import auto_class_for, auto_config, config_mapping, instantiate, quiet_transformers, short_error
from .hf.shrink import TEXT_TOKEN_LIMIT, VOCAB, TinyError, default_config, sub_configs, tiny_config
from .match.structure import expert_count, find_experts_holders

__all__ = [
    "TEXT_TOKEN_LIMIT",
    "TinyError",
    "TypeSurvey",
    "build_tiny_model",
    "experts_holders",
    "fill_uninitialised_experts",
    "make_tiny",
    "moe_model_types",
    "randomise_routers",
    "sample_input_ids",
    "survey_model_types",
    "tiny_config",  # from hp_rewrite.hf.shrink, with TinyError and TEXT_TOKEN_LIMIT
]

_EXPERT_ATTR = re.compile(r"expert", re.IGNORECASE)
_ROUTER_PARTS = frozenset({"gate", "router", "wg", "classifier", "moe_statics", "router_gate"})
_ROUTER_LEAVES = frozenset({"e_score_correction_bias", "expert_bias", "router_bias", "per_expert_scale"})


# ----------------------------------------------------------------------------------------------
# models


def build_tiny_model(config, seed: int = 0, device: str | torch.device | None = None) -> nn.Module:
    """A random-weight model of ``config`` (a config, normally from :func:`tiny_config`, or a model
    type name, which is shrunk first): fp32, ``eval()``, eager attention, built with
    :func:`auto_class_for`, routers randomised. Deterministic in ``seed``; the global RNG state is
    left untouched. ``device="meta"`` builds without storage (for structure only)."""
    if isinstance(config, str):
        config = tiny_config(config)
    model_type = getattr(config, "model_type", "?")
    try:
        cls = auto_class_for(config)
        with torch.random.fork_rng(devices=[]), quiet_transformers(), _nan_filled_empty():
            torch.manual_seed(seed)
            with torch.device(device) if device is not None else contextlib.nullcontext():
                model = instantiate(cls, copy.deepcopy(config), torch.float32)
    except ModelDirError as e:
        raise TinyError(str(e)) from e
    except Exception as e:
        raise TinyError(f"{model_type}: the tiny model cannot be built: {short_error(e)}") from e
    model.eval()
    if device is None or torch.device(device).type != "meta":
        fill_uninitialised_experts(model, seed)
        randomise_routers(model, seed)
    return model


@contextlib.contextmanager
def _nan_filled_empty():
    """``torch.empty`` gives NaN-filled floats inside (torch's deterministic mode, warnings only), so a
    weight the model's ``_init_weights`` leaves uninitialised is recognisably so; the previous settings
    are restored afterwards."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@torch.no_grad()
def fill_uninitialised_experts(model: nn.Module, seed: int = 0) -> list[str]:
    """Expert weights the model's ``_init_weights`` leaves as allocated (``torch.empty``, NaN-filled
    while :func:`build_tiny_model` builds; e.g. the Qwen3-Omni talker's experts) get
    N(0, ``initializer_range``), so the tiny model is finite and deterministic in ``seed``. Returns
    the names filled."""
    gen = torch.Generator().manual_seed(seed + 2)
    std = getattr(model.config.get_text_config(), "initializer_range", None) or 0.02
    done = []
    for holder, module, _ in experts_holders(model):
        for rel, p in module.named_parameters():
            if not p.is_floating_point() or p.numel() == 0 or p.is_meta:
                continue
            if bool(torch.isfinite(p).all()):
                continue
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
            done.append(f"{holder}.{rel}" if holder else rel)
    return done


def experts_holders(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """``(name, module, num_experts)`` of every module holding experts, in any layout
    (:func:`~hp_rewrite.match.structure.find_experts_holders` with ``any_layout``)."""
    return [(name, m, expert_count(m, name)) for name, m in find_experts_holders(model, any_layout=True)]


@torch.no_grad()
def randomise_routers(model: nn.Module, seed: int = 0) -> list[str]:
    """Randomise the router tensors of every MoE block (the holder's parent module): tensors
    outside the experts holder whose path has a router part (``gate``, ``router``, ``wg``,
    ``classifier``, ...) or a selection-bias name (``e_score_correction_bias``, ``expert_bias``,
    ...), and every all-zero floating tensor of the block. Weights (2-D and up) get N(0, 0.2);
    all-zero 1-D tensors N(0, 0.05); constant 1-D scales ``c`` get ``c * (1 + N(0, 0.05))``; 1-D
    tensors that already vary keep their values. Only persistent tensors (those
    ``save_pretrained`` writes) are touched. Returns the names randomised."""
    gen = torch.Generator().manual_seed(seed + 1)
    holders = experts_holders(model)
    holder_names = {h for h, _, _ in holders}
    persistent = set(model.state_dict().keys())
    done: list[str] = []
    parents = sorted({h.rsplit(".", 1)[0] if "." in h else "" for h in holder_names})
    for parent in parents:
        block = model.get_submodule(parent)
        prefix = f"{parent}." if parent else ""
        tensors = list(block.named_parameters()) + list(block.named_buffers())
        for rel, t in tensors:
            full = prefix + rel
            if full in done or full not in persistent or not t.is_floating_point() or t.numel() == 0:
                continue
            if any(full.startswith(h + ".") for h in holder_names):
                continue
            parts = rel.split(".")
            named = bool(_ROUTER_PARTS.intersection(parts[:-1])) or parts[-1] in _ROUTER_LEAVES
            zero = bool((t == 0).all())
            if not (named or zero):
                continue
            constant = bool((t == t.reshape(-1)[0]).all())
            if t.dim() < 2 and not constant:
                continue  # a deliberate pattern (e.g. a skip class biased to -1): transformers may re-apply it on load
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            if t.dim() >= 2:
                t.copy_(noise * 0.2)
            elif zero:
                t.copy_(noise * 0.05)
            else:
                t.copy_(t * (1 + 0.05 * noise))
            done.append(full)
    return done


def sample_input_ids(config, batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    """Plain text token ids ``[batch, seq]`` for a tiny model (below :data:`TEXT_TOKEN_LIMIT`, so
    never an image/audio placeholder or another special token)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = getattr(config.get_text_config(decoder=True), "vocab_size", VOCAB) or VOCAB
    return torch.randint(0, min(TEXT_TOKEN_LIMIT, vocab), (batch, seq), generator=gen)


# ----------------------------------------------------------------------------------------------
# checkpoints


def make_tiny(
    model_type: str | None,
    out_dir: str | os.PathLike,
    seed: int = 0,
    from_config: str | os.PathLike | None = None,
) -> Path:
    """Write a tiny random-weight checkpoint (``save_pretrained``: ``config.json`` +
    ``model.safetensors``) of ``model_type``, or of the config in ``from_config`` (a directory
    with a ``config.json``, or the file itself), shrunk. Written into a temporary directory next to
    ``out_dir`` and renamed into place; an existing non-empty ``out_dir`` is never overwritten."""
    if (model_type is None) == (from_config is None):
        raise TinyError("make_tiny: give exactly one of model_type and from_config")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TinyError(f"make_tiny: {out} exists and is not an empty directory; refusing to overwrite it")
    if from_config is not None:
        cfg = tiny_config(_read_config(Path(from_config)))
    else:
        cfg = tiny_config(model_type)
    model = build_tiny_model(cfg, seed=seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with quiet_transformers():
            model.save_pretrained(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above); fails if someone filled it meanwhile
        os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TinyError(f"make_tiny: cannot write {out}: {e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_config(path: Path):
    where = path.parent if path.is_file() else path
    if not (where / "config.json").is_file():
        raise TinyError(f"make_tiny: no config.json in {where}")
    try:
        with quiet_transformers():
            return auto_config(where)
    except Exception as e:
        raise TinyError(f"make_tiny: cannot read the config in {where}: {short_error(e)}") from e


# ----------------------------------------------------------------------------------------------
# discovery


@dataclass(frozen=True)
class TypeSurvey:
    """What :func:`survey_model_types` found for one candidate model type."""

    model_type: str
    status: str  # "moe": has experts holders; "dense": built, none found; "error": cannot be built
    holders: tuple[tuple[str, int], ...] = ()  # (module name, num_experts)
    detail: str = ""


def _has_expert_attribute(cfg, depth: int = 0) -> bool:
    names = [k for k in vars(cfg) if not k.startswith("_")] + list(type(cfg).attribute_map)
    if any(_EXPERT_ATTR.search(k) for k in names):
        return True
    return depth < 4 and any(_has_expert_attribute(sub, depth + 1) for _, sub in sub_configs(cfg))


def survey_model_types(model_types: list[str] | None = None) -> list[TypeSurvey]:
    """Every model type of the installed transformers (or ``model_types``) whose default config tree
    names an expert attribute (``num_experts``, ``n_routed_experts``, ``moe_num_experts``, ...),
    built tiny on the meta device and classified by structure (:func:`experts_holders`)."""
    out = []
    for model_type in model_types if model_types is not None else list(config_mapping().keys()):
        try:
            cfg = default_config(model_type)
        except TinyError:
            continue
        if not _has_expert_attribute(cfg):
            continue
        try:
            model = build_tiny_model(tiny_config(cfg), device="meta")
        except TinyError as e:
            out.append(TypeSurvey(model_type, "error", detail=str(e)))
            continue
        holders = tuple((name, n) for name, _, n in experts_holders(model))
        out.append(TypeSurvey(model_type, "moe" if holders else "dense", holders))
    return out


def moe_model_types() -> list[str]:
    """Every model type of the installed transformers that has MoE blocks (experts holders found by
    structure in its tiny model). Computed on each call; a type whose tiny model cannot be built is
    not listed (see :func:`survey_model_types` for those)."""
    return sorted(s.model_type for s in survey_model_types() if s.status == "moe")
