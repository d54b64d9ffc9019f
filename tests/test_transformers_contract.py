"""The model transformers would build (#25): under auto_patch, ``Cls.from_pretrained`` gives what plain
transformers gives for the same call (class, config fields, parameter dtypes, loading info, weights)
for every head class, from checkpoints saved by several of them; a bf16 checkpoint stays bf16 with sdpa."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import hp_rewrite
from hp_rewrite.errors import UserError
from hp_rewrite.hf import quiet_transformers
from hp_rewrite.hf.shrink import tiny_config
from hp_rewrite.launch import run_world
from hp_rewrite.plan import Plan
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.tiny import build_tiny_model

from .missing_experts_cases import write_checkpoints
from .save_cases import assert_same_files
from .weights_cases import weights_payload

EP1 = Plan.model_validate({"version": 1, "ep_size": 1})
FAMILIES = {"qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3", "gpt_oss": "GptOss", "mixtral": "Mixtral"}
HEADS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
SOURCES = ("ForCausalLM", "Model", "ForSequenceClassification")  # the class that saved the checkpoint
CONFIG_FIELDS = ("_attn_implementation", "dtype", "architectures", "_experts_implementation", "model_type")


def heads(family: str) -> list[str]:
    return [h for h in HEADS if hasattr(transformers, FAMILIES[family] + h)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """A bf16 checkpoint of each family, saved by each source class (the same random weights)."""
    root = tmp_path_factory.mktemp("contract")
    out = {}
    for family, prefix in FAMILIES.items():
        causal = build_tiny_model(tiny_config(family), seed=0).to(torch.bfloat16)
        for source in SOURCES:
            cls = getattr(transformers, prefix + source)
            with quiet_transformers():
                model = causal if source == "ForCausalLM" else cls._from_config(causal.config, dtype=torch.bfloat16)
                if source != "ForCausalLM":
                    base = getattr(model, model.base_model_prefix, model)
                    base.load_state_dict(causal.model.state_dict())
                model.save_pretrained(root / f"{family}-{source}")
            out[family, source] = root / f"{family}-{source}"
    return out


def _load(cls, directory: Path, **kwargs):
    torch.manual_seed(0)  # weights the checkpoint lacks are drawn in the same order on both paths
    with quiet_transformers():
        return cls.from_pretrained(directory, output_loading_info=True, **kwargs)


def _compare(plain, plain_info, ours, ours_info) -> None:
    assert type(ours) is type(plain)
    assert ours_info == plain_info
    for field in CONFIG_FIELDS:
        assert getattr(ours.config, field, None) == getattr(plain.config, field, None), field
    theirs = plain.state_dict()
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys()
    for name, t in theirs.items():
        assert mine[name].dtype == t.dtype and mine[name].device == t.device, name
        assert torch.equal(mine[name], t), name
    assert ours.hp_rewrite.patched and not ours.training


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_head_class_from_checkpoints_of_several_classes(family, checkpoints, tmp_path) -> None:
    for source in SOURCES:
        for head in heads(family):
            cls = getattr(transformers, FAMILIES[family] + head)
            plain, plain_info = _load(cls, checkpoints[family, source])
            with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
                ours, ours_info = _load(cls, checkpoints[family, source])
            _compare(plain, plain_info, ours, ours_info)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_checkpoint_stays_bf16_with_sdpa_and_computes_the_same(family, checkpoints, tmp_path) -> None:
    """Defaults as transformers: the checkpoint's dtype and sdpa; through the Auto class and through
    hp_rewrite.from_pretrained; the forward equals the unmodified model's (fp32 tight when asked for)."""
    directory = checkpoints[family, "ForCausalLM"]
    auto = transformers.AutoModelForCausalLM
    plain = auto.from_pretrained(directory)
    with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        ours = auto.from_pretrained(directory)
    one_call = hp_rewrite.from_pretrained(directory, plan=EP1, artifact_dir=tmp_path / "art")
    for model in (ours, one_call):
        assert type(model) is type(plain) and model.dtype == torch.bfloat16 == plain.dtype
        assert model.config._attn_implementation == plain.config._attn_implementation
    # transformers' choice: sdpa, except for gpt-oss, whose attention sinks sdpa lacks
    assert plain.config._attn_implementation == ("eager" if family == "gpt_oss" else "sdpa")
    ids = torch.randint(0, plain.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    plain32 = auto.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        ours32 = auto.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    assert ours32.config._attn_implementation == "eager" and ours32.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(ours32(input_ids=ids).logits, plain32(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        # bf16: the same weights; the local experts sum in another order than transformers' grouped_mm
        torch.testing.assert_close(ours(input_ids=ids).logits.float(), plain(input_ids=ids).logits.float(),
                                   rtol=0, atol=0.1)
    # fp32 with transformers' default attention, in training mode: logits and every gradient
    plain_sdpa = auto.from_pretrained(directory, dtype=torch.float32).train()
    with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        ours_sdpa = auto.from_pretrained(directory, dtype=torch.float32).train()
    upstream = torch.randn(2, 8, plain.config.vocab_size, generator=torch.Generator().manual_seed(1))
    for model in (plain_sdpa, ours_sdpa):
        (model(input_ids=ids).logits * upstream).sum().backward()
    theirs = dict(plain_sdpa.named_parameters())
    for name, p in ours_sdpa.named_parameters():
        ref = theirs[name].grad
        if ref is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=name)


def test_whole_model_paths_warn_and_bad_device_maps_are_refused(checkpoints, tmp_path) -> None:
    directory = checkpoints["qwen3_moe", "ForCausalLM"]
    state = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        with pytest.warns(UserWarning, match=r"whole model .*state_dict"):
            model = transformers.Qwen3MoeForCausalLM.from_pretrained(None, config=transformers.AutoConfig.from_pretrained(
                directory), state_dict=state)
        assert model.hp_rewrite.patched and model.dtype == torch.bfloat16
        with pytest.raises(ExpertParallelError, match="device_map"):
            transformers.AutoModelForCausalLM.from_pretrained(directory, device_map={"model": "cpu", "lm_head": "meta"})
        single = transformers.AutoModelForCausalLM.from_pretrained(directory, device_map="cpu")
        assert single.hp_rewrite.load_report is not None and single.device.type == "cpu"


def test_expert_parallel_load_keeps_transformers_defaults(checkpoints, tmp_path) -> None:
    """At EP=2 on gloo: the class, bf16 and sdpa of plain transformers, only this rank's experts read."""
    payload = {"model_dir": str(checkpoints["qwen3_moe", "ForCausalLM"]), "out_dir": str(tmp_path)}
    for r in run_world(2, "tests.training_cases:contract_world", payload):
        assert r["class"] == "Qwen3MoeForCausalLM" and r["dtype"] == "torch.bfloat16" and r["attn"] == "sdpa", r
        assert r["local"] == [r["experts"] // 2] * len(r["local"]), r
        assert r["bytes_read"] < r["file_bytes"], r
        assert r["err"] <= 0.1, r


def test_every_head_class_at_ep2_loads_and_saves_as_transformers(checkpoints, tmp_path) -> None:
    """At EP=2 on gloo, every Qwen3-MoE head class from a causal-LM and a base-model checkpoint: plain
    transformers' class, loading info, tensors (this rank's expert rows) and output, only this rank's
    experts read; what each saves (collectively) is file for file what plain transformers saves."""
    prefix = FAMILIES["qwen3_moe"]
    loads = [(prefix + head, source, str(checkpoints["qwen3_moe", source]))
             for head in heads("qwen3_moe") for source in ("ForCausalLM", "Model")]
    # from a classifier's checkpoint with ignore_mismatched_sizes (#35): re-initialised as transformers
    # does, expert tensors too (this rank's rows of what plain transformers draws, #44); the question-
    # answering head is left out: its body's prefix takes nothing from this checkpoint, nothing mismatches
    classifier = checkpoints["qwen3_moe", "ForSequenceClassification"]
    mismatched = [(prefix + head, str(classifier), changes) for head in heads("qwen3_moe")
                  if head != "ForQuestionAnswering" for changes in _mismatching_changes("qwen3_moe", classifier).values()]
    # experts the checkpoint lacks or mismatches (#44), every family: tests/missing_experts_cases.py
    missing = {**write_checkpoints(tmp_path / "missing"), "out_dir": str(tmp_path / "missing"), "plans": [{"ep": 2}]}
    # checkpoint_weights at EP 2, every family, LoRA merged (#46): tests/weights_cases.py
    weights = weights_payload(tmp_path / "missing", tmp_path / "weights", [{"ep": 2, "peft": True}])
    payload = {"loads": loads, "out_dir": str(tmp_path), "mismatched": mismatched, "missing": missing,
               "weights": weights}
    for r in run_world(2, "tests.training_cases:contract_heads_world", payload):
        assert not r["problems"] and len(r["checked"]) == len(loads) + len(mismatched), r
        assert not r["missing"]["problems"] and r["missing"]["drawn"] >= 40, r["missing"]
        assert not r["weights"]["problems"] and len(r["weights"]["checked"]) == 7, r["weights"]
    # the question-answering head keeps its body under another prefix ("transformer."), which the causal
    # LM's checkpoint ("model.") does not fill, as in plain transformers: its experts are drawn as plain
    # transformers draws them (#44), so what it saves is what plain transformers saves too
    for cls_name, source, directory in loads:
        torch.manual_seed(0)
        with quiet_transformers():
            getattr(transformers, cls_name).from_pretrained(directory).save_pretrained(tmp_path / "plain" / cls_name)
        assert_same_files(tmp_path / "saved" / f"{cls_name}-{source}", tmp_path / "plain" / cls_name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_pretrained_writes_what_transformers_writes(family, checkpoints, tmp_path) -> None:
    """One file below max_shard_size, shards + index above it (the same cut), the checkpoint format's
    names by default, the in-memory ones with save_original_format=False, the same config.json."""
    directory = checkpoints[family, "ForCausalLM"]
    plain = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        ours = transformers.AutoModelForCausalLM.from_pretrained(directory)
    options = [{}, {"max_shard_size": "60KB"}, {"max_shard_size": "60KB", "save_original_format": False},
               {"safe_serialization": False, "is_main_process": True}]
    for i, kwargs in enumerate(options):
        with quiet_transformers():
            plain.save_pretrained(tmp_path / f"plain{i}", **kwargs)
            ours.save_pretrained(tmp_path / f"ours{i}", **kwargs)
        assert_same_files(tmp_path / f"ours{i}", tmp_path / f"plain{i}")
    assert (tmp_path / "ours0" / "model.safetensors").is_file()
    assert (tmp_path / "ours1" / "model.safetensors.index.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours0")
    for name, t in plain.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], t), name


def test_save_pretrained_refuses_what_it_cannot_honour_by_name(checkpoints, tmp_path) -> None:
    with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        ours = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe", "ForCausalLM"])
    for kwargs, name in (({"push_to_hub": True}, "push_to_hub"), ({"variant": "ema"}, "variant"),
                         ({"distributed_checkpoint": True}, "distributed_checkpoint")):
        with pytest.raises(ExpertParallelError, match=name):
            ours.save_pretrained(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_pretrained_options_behave_as_in_transformers(family, checkpoints, tmp_path) -> None:
    """subfolder, key_mapping, config=, use_safetensors, low_cpu_mem_usage, local_files_only, revision:
    transformers resolves them, only the reading of the weights is ours (and reads only local experts)."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = checkpoints[family, "ForCausalLM"]
    shutil.copytree(source, tmp_path / "repo" / "sub")
    renamed = tmp_path / "renamed"
    shutil.copytree(source, renamed)
    state = load_file(renamed / "model.safetensors")
    save_file({k.replace("model.", "backbone.", 1): v for k, v in state.items()}, renamed / "model.safetensors",
              metadata={"format": "pt"})
    config = transformers.AutoConfig.from_pretrained(source, output_router_logits=True)
    cls = getattr(transformers, FAMILIES[family] + "ForCausalLM")
    calls = [
        (tmp_path / "repo", {"subfolder": "sub"}),
        (renamed, {"key_mapping": {r"^backbone\.": "model."}}),
        (source, {"config": config}),
        (source, {"use_safetensors": True, "low_cpu_mem_usage": True, "local_files_only": True, "revision": "main"}),
        (source, {"dtype": "auto", "attn_implementation": "eager", "output_router_logits": True}),
    ]
    for directory, kwargs in calls:
        plain, plain_info = _load(cls, directory, **kwargs)
        with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
            ours, ours_info = _load(cls, directory, **kwargs)
        _compare(plain, plain_info, ours, ours_info)
        assert ours.config.output_router_logits == plain.config.output_router_logits, kwargs
        assert ours.hp_rewrite.load_report is not None, kwargs  # read by rank, not the whole-model path


def test_meta_device(checkpoints, tmp_path) -> None:
    """A model built under torch.device("meta") is rewritten with no cached artifact (the probe runs on
    real tiny tensors) and stays on meta; a meta-device from_pretrained gives transformers' own error."""
    from hp_rewrite.hf import auto_class_for, instantiate
    from hp_rewrite.loading.patch import rewrite_model

    config = tiny_config("deepseek_v3")
    with torch.device("meta"):
        model = rewrite_model(instantiate(auto_class_for(config), config), EP1, artifact_dir=tmp_path / "fresh")
    assert model.hp_rewrite.patched and all(p.is_meta for p in model.parameters())
    errors = []
    for patched in (False, True):
        with pytest.raises(RuntimeError) as e, torch.device("meta"):
            if patched:
                with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
                    transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe", "ForCausalLM"])
            else:
                transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe", "ForCausalLM"])
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "meta device" in errors[0]


# config fields whose change gives the experts other shapes than the checkpoint's: (size, count)
EXPERT_FIELDS = {"qwen3_moe": ("moe_intermediate_size", "num_experts"),
                 "deepseek_v3": ("moe_intermediate_size", "n_routed_experts"),
                 "gpt_oss": ("intermediate_size", "num_local_experts"),
                 "mixtral": ("intermediate_size", "num_local_experts")}


def _mismatching_changes(family: str, directory: Path) -> dict[str, dict]:
    """from_pretrained overrides that mismatch the checkpoint: the heads and embeddings, or the experts."""
    config = transformers.AutoConfig.from_pretrained(directory)
    size, count = EXPERT_FIELDS[family]
    return {"non_expert": {"num_labels": 42, "vocab_size": config.vocab_size + 8},
            "expert": {size: getattr(config, size) * 2, count: getattr(config, count) * 2}}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ignore_mismatched_sizes_reinitialises_as_transformers(family, checkpoints, tmp_path) -> None:
    """A classifier's checkpoint loaded with another head size (and other vocabulary or expert sizes),
    every head class, ignore_mismatched_sizes=True: the tensors transformers re-initialises, with the
    same values (same init, same seed), the same loading info (mismatched_keys with every expert
    counted) and the same log line; without the flag both raise a RuntimeError."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    directory = checkpoints[family, "ForSequenceClassification"]
    changes = _mismatching_changes(family, directory)
    for head in heads(family):
        cls = getattr(transformers, FAMILIES[family] + head)
        for what, kwargs in changes.items():
            plain, plain_info = _load(cls, directory, ignore_mismatched_sizes=True, **kwargs)
            with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
                ours, ours_info = _load(cls, directory, ignore_mismatched_sizes=True, **kwargs)
            _compare(plain, plain_info, ours, ours_info)
            if head == "ForSequenceClassification":  # the case: the head, and the experts
                names = {name for name, _, _ in ours_info["mismatched_keys"]}
                assert ("score.weight" in names) == (what == "non_expert"), names
                assert any(".experts." in n for n in names) == (what == "expert"), names
    cls = getattr(transformers, FAMILIES[family] + "ForSequenceClassification")
    with CaptureLogger(hf_logging.get_logger("transformers.modeling_utils")) as log:
        with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
            cls.from_pretrained(directory, ignore_mismatched_sizes=True, num_labels=42)
    assert "score.weight" in log.out and "Reinit due to size mismatch" in log.out
    for kwargs in changes.values():
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            _load(cls, directory, **kwargs)
        with pytest.raises(RuntimeError) as e, hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
            _load(cls, directory, **kwargs)
        assert isinstance(e.value, UserError), e.value  # the CLI's clean message, and our words:
        assert "the model expects" in str(e.value) and "ignore_mismatched_sizes=True" in str(e.value), e.value


def test_errors_are_of_the_type_transformers_raises(checkpoints, tmp_path) -> None:
    """A checkpoint file that is unreadable, truncated or absent, and a save into a path that is a file:
    what plain transformers does (the same exception type, keeping our message; the same logged error
    and nothing written); the from_pretrained options transformers rejects, rejected by it."""
    import shutil

    source = checkpoints["qwen3_moe", "ForCausalLM"]
    bad = {}
    for name in ("corrupt", "truncated", "absent_shard"):
        shutil.copytree(source, bad.setdefault(name, tmp_path / name))
    (bad["corrupt"] / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{not json}" + b" " * 6)
    whole = (source / "model.safetensors").read_bytes()
    (bad["truncated"] / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    (bad["absent_shard"] / "model.safetensors").unlink()
    transformers.AutoModelForCausalLM.from_pretrained(source).save_pretrained(bad["absent_shard"], max_shard_size="60KB")
    next(iter(sorted(bad["absent_shard"].glob("model-00002-*.safetensors")))).unlink()
    cls = transformers.Qwen3MoeForCausalLM
    for name, directory in bad.items():
        with pytest.raises(Exception) as theirs:
            cls.from_pretrained(directory)
        with pytest.raises(Exception) as ours, hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
            cls.from_pretrained(directory)
        assert isinstance(ours.value, type(theirs.value)), (name, ours.value, theirs.value)
        assert isinstance(ours.value, OSError) and isinstance(ours.value, UserError), (name, ours.value)
        assert str(directory) in str(ours.value), ours.value
    assert isinstance(ours.value, FileNotFoundError)  # the absent shard, as transformers
    for kwargs in ({"dtype": "float17"}, {"attn_implementation": "nope"}, {"device_map": "nonsense"}):
        with pytest.raises(ValueError), hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
            cls.from_pretrained(source, **kwargs)
    with pytest.raises(OSError):
        hp_rewrite.from_pretrained(tmp_path / "nothing", plan=EP1, artifact_dir=tmp_path / "art")

    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    plain = transformers.AutoModelForCausalLM.from_pretrained(source)
    with hp_rewrite.auto_patch(EP1, artifact_dir=tmp_path / "art"):
        ours_model = transformers.AutoModelForCausalLM.from_pretrained(source)
    logs = []
    for model in (plain, ours_model):
        with CaptureLogger(hf_logging.get_logger("transformers.modeling_utils")) as log:
            assert model.save_pretrained(a_file) is None
        logs.append(log.out)
    assert logs[0] == logs[1] and "should be a directory, not a file" in logs[0]
    assert a_file.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
