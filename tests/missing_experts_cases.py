"""Experts the checkpoint lacks (#44), on every rank of a real gloo world: ``from_pretrained`` under
``auto_patch`` at EP = world against plain transformers in the same process, the same seed before both.
Every tensor bit-equal to plain transformers' (this rank's rows of an expert tensor), the loading info
and transformers' log lines equal, and the drawn experts of different ranks different."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file, save_file

from hp_rewrite import auto_patch
from hp_rewrite.hf import quiet_transformers
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.binding.install import expert_weights, local_rows
from hp_rewrite.tiny import build_tiny_model, tiny_config

#: the families, their causal-LM class, their experts' width field and how their checkpoints store experts
FAMILIES = {"qwen3_moe": ("Qwen3MoeForCausalLM", "moe_intermediate_size"),
            "deepseek_v3": ("DeepseekV3ForCausalLM", "moe_intermediate_size"),
            "mixtral": ("MixtralForCausalLM", "intermediate_size"),
            "gpt_oss": ("GptOssForCausalLM", "intermediate_size"),
            # experts held as modules (a ModuleDict of MLPs): other ranks' experts are absent here
            "switch_transformers": ("SwitchTransformersForConditionalGeneration", "d_ff")}


def _moe_layers(keys) -> list[str]:
    """The ``...layers.N.<mlp>.experts.`` prefixes of the routed experts, in layer order."""
    out = []
    for k in keys:
        if ".experts." in k:
            prefix = k[: k.index(".experts.") + len(".experts.")]
            if prefix not in out:
                out.append(prefix)
    return out


def _without(source: Path, directory: Path, drop) -> Path:
    """A copy of the one-file checkpoint ``source`` without the tensors ``drop(key)`` selects."""
    tensors = load_file(source / "model.safetensors")
    kept = {k: t for k, t in tensors.items() if not drop(k)}
    assert len(kept) < len(tensors), directory
    directory.mkdir()
    save_file(kept, directory / "model.safetensors", metadata={"format": "pt"})
    for f in source.iterdir():
        if f.suffix in (".json", ".py"):
            (directory / f.name).write_bytes(f.read_bytes())
    return directory


def _down(k: str) -> bool:
    return k.endswith((".down_proj.weight", ".w2.weight", ".wo.weight")) or k.endswith(".down_proj")


def write_checkpoints(root: Path) -> dict:
    """For each family a bf16 checkpoint in its Hub layout (per-expert keys where the Hub has them, fused
    for gpt-oss, a ModuleDict for Switch, a ModuleList in remote code) and its variants: the last MoE
    layer's routed experts gone, the first MoE layer's down projection gone; the loads to compare (class,
    directory, from_pretrained keywords) and the loads to refuse."""
    from .remote_code import write_checkpoint

    loads = []
    for family, (causal, width) in FAMILIES.items():
        model = build_tiny_model(tiny_config(family), seed=0).to(torch.bfloat16)
        full = root / family
        with quiet_transformers():
            model.save_pretrained(full)
        layers = _moe_layers(load_file(full / "model.safetensors"))
        layer = _without(full, root / f"{family}-layer", lambda k, p=layers[-1]: k.startswith(p))
        projection = _without(full, root / f"{family}-projection", lambda k, p=layers[0]: k.startswith(p) and _down(k))
        loads += [{"cls": causal, "dir": str(layer), "kwargs": {}, "save": True},
                  {"cls": causal, "dir": str(projection), "kwargs": {}},
                  {"cls": causal, "dir": str(full),
                   "kwargs": {width: getattr(model.config, width) * 2, "ignore_mismatched_sizes": True}}]
        qa = causal.replace("ForCausalLM", "ForQuestionAnswering")
        if hasattr(transformers, qa):  # its body's prefix may take nothing from a causal LM's checkpoint
            loads.append({"cls": qa, "dir": str(full), "kwargs": {}})
    remote = write_checkpoint(root / "remote")
    transformers.AutoConfig.from_pretrained(remote, trust_remote_code=True)  # cached before the ranks import it
    layers = _moe_layers(load_file(remote / "model.safetensors"))
    remote_layer = _without(remote, root / "remote-layer", lambda k: k.startswith(layers[-1]))
    loads.append({"cls": "AutoModelForCausalLM", "dir": str(remote_layer), "kwargs": {"trust_remote_code": True}})
    refusals = [{"cls": "Qwen3MoeForCausalLM", "dir": str(root / "qwen3_moe-layer"), "kwargs": {}, "data_style_init": True,
                 "match": ["model.layers.1.mlp.experts.", "outside torch.nn.init", "ep_size 1"]}]
    return {"loads": loads, "refusals": refusals}


def _load(cls, directory: str, kwargs: dict, plan=None, art: Path | None = None):
    """``from_pretrained`` after ``torch.manual_seed(0)``, with transformers' loading log captured and,
    after it, where the random stream stands (the same after both loads: as many numbers drawn)."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    torch.manual_seed(0)
    with CaptureLogger(hf_logging.get_logger("transformers.modeling_utils")) as log:
        if plan is None:
            model, info = cls.from_pretrained(directory, output_loading_info=True, **kwargs)
        else:
            with auto_patch(plan, artifact_dir=art):
                model, info = cls.from_pretrained(directory, output_loading_info=True, **kwargs)
    return model, info, log.out + f"\nrandom stream at {_digest(torch.random.get_rng_state())}"


def _lines(log: str) -> list[str]:
    """The log's lines, sorted: transformers lists the keys in the order of its sets."""
    return sorted(log.splitlines())


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


@contextlib.contextmanager
def _data_style_init():
    """Qwen3-MoE's ``_init_weights`` as a user's fork might write it: the experts drawn through ``.data``,
    not per tensor through ``torch.nn.init``. Its draws cannot be followed at EP > 1: refused."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    original = m.Qwen3MoePreTrainedModel._init_weights

    def _init_weights(self, module):
        if isinstance(module, m.Qwen3MoeExperts):
            module.gate_up_proj.data.normal_(0.0, 0.02)
            module.down_proj.data.normal_(0.0, 0.02)
        else:
            original(self, module)

    m.Qwen3MoePreTrainedModel._init_weights = _init_weights
    try:
        yield
    finally:
        m.Qwen3MoePreTrainedModel._init_weights = original


@contextlib.contextmanager
def _init_temporaries():
    """The most bytes of tensors alive at once that the initialisation of what the checkpoint lacks made
    (a list holding it once the block ends; empty when no exact draw ran)."""
    from hp_rewrite.loading import local

    from .host_traffic import LiveTemporaries

    original, peak = local.PreparedLoad.initialise_missing, []

    def measured(self):
        with LiveTemporaries() as live:
            original(self)
        peak.append(live.peak)

    local.PreparedLoad.initialise_missing = measured
    try:
        yield peak
    finally:
        local.PreparedLoad.initialise_missing = original


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # TP-split dense tensors


def _compare(load: dict, plan, art: Path, world: int, saved: Path | None) -> tuple[list[str], int]:
    """One load plain and expert-parallel: the problems, and how many random expert tensors were drawn."""
    cls = getattr(transformers, load["cls"])
    where = f"{load['cls']} {Path(load['dir']).name} {sorted(load['kwargs'])} tp{plan.tp_size}"
    problems = []
    plain, plain_info, plain_log = _load(cls, load["dir"], load["kwargs"])
    with _init_temporaries() as peak:
        ours, ours_info, ours_log = _load(cls, load["dir"], load["kwargs"], plan, art)
    drawn = set(plain_info["missing_keys"]) | {n for n, _, _ in plain_info["mismatched_keys"]}
    largest = max((t.numel() * t.element_size() for n, t in plain.state_dict().items() if n in drawn), default=0)
    if peak and peak[0] > largest + 2**12:  # one parameter at its full size (and the rotary tables)
        problems.append(f"{where}: {peak[0]} bytes drawn at once, the largest tensor drawn is {largest}")
    if ours_info != plain_info:
        problems.append(f"{where}: loading info {ours_info} vs {plain_info}")
    if _lines(ours_log) != _lines(plain_log):
        problems.append(f"{where}: log {ours_log!r} vs {plain_log!r}")
    experts, theirs = expert_weights(ours), plain.state_dict()
    mine = []
    for name, t in ours.state_dict().items():
        t = _full(t)
        want = local_rows(*experts[name], theirs[name]) if name in experts else theirs[name]
        if t.dtype != want.dtype or t.shape != want.shape or not torch.equal(t, want):
            problems.append(f"{where}: {name} differs from plain transformers' " + ("rows" if name in experts else "tensor"))
        if name in experts and name in drawn and theirs[name].unique().numel() > 1:  # random, not zeros
            mine.append(_digest(t))
    if not mine and any(n in experts for n in drawn):
        problems.append(f"{where}: no random expert tensor drawn")
    held = tuple(tuple(installed.binding(h).placement.local_experts) for h, _ in experts.values())
    every: list = [None] * world
    dist.all_gather_object(every, (held, mine))  # ranks of one TP group hold the same experts
    if mine and any(set(a) & set(b) for i, (e, a) in enumerate(every) for f, b in every[i + 1:] if e != f):
        problems.append(f"{where}: ranks holding other experts drew equal ones")
    if saved is not None:  # collective; the files are what plain transformers writes
        from .save_cases import assert_same_files

        if ours.save_pretrained(saved / "ours") is not None:
            problems.append(f"{where}: save_pretrained returned something")
        if dist.get_rank() == 0:
            plain.save_pretrained(saved / "plain")
            try:
                assert_same_files(saved / "ours", saved / "plain")
            except AssertionError as e:
                problems.append(f"{where}: saved files differ: {str(e)[:300]}")
    return problems, len(mine)


def _refused(refusal: dict, plan, art: Path) -> str | None:
    """The load must fail with an error naming the reason; what went wrong otherwise."""
    from hp_rewrite.errors import UserError

    cls = getattr(transformers, refusal["cls"])
    try:
        with _data_style_init() if refusal.get("data_style_init") else contextlib.nullcontext():
            _load(cls, refusal["dir"], refusal["kwargs"], plan, art)
    except UserError as e:
        return None if all(m in str(e) for m in refusal["match"]) else f"{refusal['cls']}: {e}"
    return f"{refusal['cls']} {refusal['dir']}: loaded, not refused"


def missing_experts_world(rank: int, world: int, payload: dict) -> dict:
    """Each load of ``payload["loads"]`` plain and expert-parallel under each plan of ``payload["plans"]``
    (``{"ep": n, "tp": t, "only": [substrings of the checkpoint directories]}``), then the refusals;
    the problems found, and how many random expert tensors were compared."""
    torch.set_num_threads(1)
    art, problems, drawn = Path(payload["out_dir"]) / "art", [], 0
    for p in payload["plans"]:
        plan = parse_plan(f"version: 1\nep_size: {p['ep']}\ntp_size: {p.get('tp', 1)}\n")
        for i, load in enumerate(payload["loads"]):
            if p.get("only") and not any(o in Path(load["dir"]).name for o in p["only"]):
                continue
            saved = Path(payload["out_dir"]) / f"saved-{p['ep']}-{p.get('tp', 1)}-{i}" if load.get("save") else None
            found, n = _compare(load, plan, art, world, saved)
            problems += found
            drawn += n
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    problems += [p for r in payload.get("refusals", []) if (p := _refused(r, plan, art)) is not None]
    return {"problems": problems, "drawn": drawn}
