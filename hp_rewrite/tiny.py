"""Tiny random-weight transformers models, built from config classes only (nothing is downloaded).

Shipped for ``hp-rewrite make-tiny`` and used by the tests and tools. The config is shrunk by
:func:`hp_rewrite.hf.shrink.tiny_config`; ``build_tiny_model`` builds the model with the right class
(:func:`hp_rewrite.hf.auto_class_for`), in fp32, ``eval()``, with eager attention, fills expert
weights its ``_init_weights`` leaves uninitialised (:func:`fill_uninitialised_experts`), and randomises
router weights, router biases and selection-bias buffers (:func:`randomise_routers`; transformers
initialises several to zeros, which makes routing degenerate). ``make_tiny`` writes a real
checkpoint (``config.json`` + ``model.safetensors``) atomically, or (``quantize``) one in the MXFP4 or
block-FP8 layout the Hub ships (:func:`write_quantized`). ``moe_model_types`` finds, by
structure, every model type of the installed transformers whose tiny model holds experts
(:func:`hp_rewrite.match.structure.find_experts_holders` with ``any_layout``: the one experts-holder
detector). Nothing is cached between calls.
"""

from __future__ import annotations

import contextlib
import copy
import json
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
from .loading.checkpoint_files import INDEX_FILE, SINGLE_FILE
from .loading.quantized import (
    MXFP4_GROUP,
    fp8_linear_weights,
    hub_quantization_config,
    quantize_fp8,
    quantize_mxfp4,
)
from .match.structure import expert_count, find_experts_holders

__all__ = [
    "QUANTIZE_CHOICES",
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
    "write_quantized",
]

QUANTIZE_CHOICES = ("mxfp4", "fp8")

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


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer over a tiny vocabulary (words ``t0`` .. ``t{V-1}`` split on spaces; ``t1`` pads,
    ``t2`` ends), so recipes that need one (TRL's trainers) run on a tiny checkpoint as on the Hub's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t1", eos_token="t2")


# ----------------------------------------------------------------------------------------------
# checkpoints


def make_tiny(
    model_type: str | None,
    out_dir: str | os.PathLike,
    seed: int = 0,
    from_config: str | os.PathLike | None = None,
    quantize: str | None = None,
) -> Path:
    """Write a tiny random-weight checkpoint (``save_pretrained``: ``config.json`` +
    ``model.safetensors``, and a word-level tokenizer: :func:`tiny_tokenizer`) of ``model_type``, or of the
    config in ``from_config`` (a directory
    with a ``config.json``, or the file itself), shrunk. Written into a temporary directory next to
    ``out_dir`` and renamed into place; an existing non-empty ``out_dir`` is never overwritten.
    ``quantize`` (``mxfp4`` | ``fp8``): in bf16 and that quantised layout, as the Hub ships it
    (:func:`write_quantized`)."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise TinyError(f"make_tiny: quantize={quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
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
            if quantize is not None:
                as_bf16(model)
            model.save_pretrained(tmp)
            vocab = getattr(cfg.get_text_config(decoder=True), "vocab_size", VOCAB) or VOCAB
            tiny_tokenizer(vocab).save_pretrained(tmp)
        if quantize is not None:
            write_quantized(model, tmp, quantize)
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


# ----------------------------------------------------------------------------------------------
# quantised checkpoints in the Hub's layouts (make-tiny --quantize)
#
# write_quantized turns a plain checkpoint written by save_pretrained into the layout of the real
# releases, sharded with an index: mxfp4 (gpt-oss) turns the fused expert tensors into *_blocks /
# *_scales, attention, router, embeddings and head stay as they are (modules_to_not_convert); fp8
# (DeepSeek-V3, Kimi-K2, Qwen3-FP8) turns every Linear weight of the decoder (attention, dense and
# shared MLPs, each routed expert under its own key) into float8_e4m3fn with a weight_scale_inv per
# block; routers, norms, embeddings and head stay as they are.

TINY_FP8_BLOCK = (4, 4)  # divides every tiny dimension, as transformers needs (the Hub's is 128 x 128)
_PER_EXPERT = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def write_quantized(model: nn.Module, plain_dir: Path, method: str, shards: int = 2) -> None:
    """Rewrite the plain checkpoint of ``model`` in ``plain_dir`` (``save_pretrained``) in place, quantised
    with ``method`` into ``shards`` files and an index."""
    from safetensors.torch import load_file, save_file

    state = load_file(plain_dir / SINGLE_FILE)
    config = json.loads((plain_dir / "config.json").read_text())
    if method == "mxfp4":
        state, qconfig = _mxfp4(state, config)
    elif method == "fp8":
        state, qconfig = _fp8(model, state, config)
    else:
        raise TinyError(f"quantize={method!r}: choose one of {', '.join(QUANTIZE_CHOICES)}")
    (plain_dir / SINGLE_FILE).unlink()
    keys = sorted(state)
    per_file = -(-len(keys) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys[i * per_file : (i + 1) * per_file]}
        save_file(part, plain_dir / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (plain_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config["quantization_config"] = qconfig
    (plain_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _mxfp4(state: dict, config: dict) -> tuple[dict, dict]:
    fused = [k for k in state if _FUSED.search(k) and state[k].dim() == 3]
    if not fused:
        raise TinyError(f"quantize=mxfp4: {config.get('model_type')} keeps no fused gate_up_proj / down_proj "
                        "expert tensors; the MXFP4 Hub layout is gpt-oss's (try gpt_oss)")
    for key in fused:
        value = state.pop(key).transpose(1, 2)  # in-first [E, in, out] -> out-first [E, out, in]
        if value.shape[-1] % MXFP4_GROUP:
            raise TinyError(f"quantize=mxfp4: {key} has {value.shape[-1]} inputs, not a multiple of 32")
        state[f"{key}_blocks"], state[f"{key}_scales"] = quantize_mxfp4(value)
    return state, hub_quantization_config("mxfp4")


def _fp8(model: nn.Module, state: dict, config: dict) -> tuple[dict, dict]:
    linears = fp8_linear_weights(model)
    chosen = [k for k in state if state[k].dim() == 2 and (k in linears or _PER_EXPERT.search(k))]
    if not any(_PER_EXPERT.search(k) for k in chosen):
        raise TinyError(f"quantize=fp8: {config.get('model_type')} does not save its experts one key per "
                        "expert; the block-FP8 Hub layout is DeepSeek-V3's (try deepseek_v3 or qwen3_moe)")
    for key in chosen:
        state[key], state[f"{key}_scale_inv"] = quantize_fp8(state[key], TINY_FP8_BLOCK)
    return state, hub_quantization_config("fp8", TINY_FP8_BLOCK)


def as_bf16(model: nn.Module) -> nn.Module:
    """The model in bf16, as the quantised releases ship their unquantised tensors."""
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    return model
