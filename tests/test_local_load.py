"""Only-local-experts loading (``hp_rewrite.loading.local.load_expert_parallel``).

Checkpoints are tiny random-weight ones written by ``save_pretrained`` (``make_tiny``), in the
on-disk layouts transformers writes: Qwen3-MoE and DeepSeek-V3 (dense first layer, shared
experts) per-expert ``mlp.experts.{i}.{gate,up,down}_proj.weight``; Mixtral
``block_sparse_moe.experts.{i}.w1/w3/w2.weight``; GPT-OSS fused native names with biases; GraniteMoE
``block_sparse_moe.input_linear/output_linear`` and ``router.layer``; and a Qwen3-MoE with tied
embeddings saved in 7 shards (``model.safetensors.index.json``).

* EP=1 (in this process, one thread): every tensor is bit-identical to ``from_pretrained``'s, the
  logits are bit-identical to ``from_pretrained`` + the same rewrite installed, and within 1e-6
  (relative to the largest logit) of the unmodified ``from_pretrained`` model. The rewritten
  forward adds the expert outputs in another order than transformers' loop, so bit equality with
  the unmodified model holds on one thread here but is not a property of the loader; every
  tensor is copied to fresh storage before a forward (safetensors' memory-mapped tensors can be
  misaligned, and CPU GEMM kernels then take other vectorised paths: 1-ulp differences).
* EP=2 on 2 gloo ranks: each rank's expert tensors equal its slice of the full model's, every
  other tensor equals the full model's, exactly the local expert bytes are read from the files, and
  the EP forward matches the unmodified model on the rank's share of a batch (1e-5 relative).
* Memory, EP=4 on 4 gloo ranks: see :func:`test_peak_memory_is_local_share`.
"""

from __future__ import annotations

import gc
import json
import resource
from pathlib import Path

import pytest
import torch

from hp_rewrite.launch import run_world
from hp_rewrite.loading.local import CheckpointKeyError, load_expert_parallel
from hp_rewrite.plan import DEFAULT_PLAN, parse_plan
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.group.groups import ExpertParallelGroup
from hp_rewrite.tiny import build_tiny_model, make_tiny, sample_input_ids, tiny_config

FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "granitemoe", "qwen3_tied_sharded", "dbrx", "jetmoe"]
BALANCED = ["qwen3_moe", "gpt_oss", "granitemoe", "dbrx"]  # also loaded with the plan's balanced placement
MEMORY_SLACK = 1.15


def _plan(ep_size: int):
    return parse_plan(f"version: 1\nep_size: {ep_size}\narchetype: auto\n")


def _make(name: str, out: Path) -> Path:
    if name == "qwen3_tied_sharded":
        cfg = tiny_config("qwen3_moe")
        cfg.tie_word_embeddings = True
        model = build_tiny_model(cfg)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        model.save_pretrained(out, max_shard_size="100KB")
        return out
    return make_tiny(name, out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("local-load")
    return {name: _make(name, root / name) for name in FAMILIES}


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(model_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)  # transformers' defaults, as the loader's
    _fresh(model)
    return model.eval()


def _fresh(model: torch.nn.Module) -> None:
    """Copy every tensor into fresh (aligned) storage, keeping tied parameters tied."""
    for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values():
        t.data = t.data.clone()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _expert_owner(model, name: str):
    """(binding, layout) of the holder of expert weight ``name`` (flat layouts: a path below it), else None."""
    for path, m in model.named_modules():
        binding = installed.binding(m)
        if binding is not None and name in {f"{path}.{w}" for w in installed.layout(m).weight_names}:
            return binding, installed.layout(m)
    return None


def _checkpoint_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                total += torch.Size(t.get_shape()).numel() * 4  # every test checkpoint is fp32
    return total


# ----------------------------------------------------------------------------------------------
# EP=1


@pytest.mark.parametrize(("family", "attention"), [("qwen3_moe", "sdpa"), ("gpt_oss", "eager")])
def test_bf16_checkpoint_loads_with_transformers_defaults(family, attention, tmp_path, artifact_dir):
    """The direct loader (and load_fully_sharded, which shares its prepare step) defaults to what
    from_pretrained gives: a bf16 checkpoint stays bf16, with transformers' attention choice."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(tiny_config(family), seed=0).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    model, _ = load_expert_parallel(tmp_path / "m", DEFAULT_PLAN, ExpertParallelGroup.single(), artifact_dir)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert (model.dtype, model.config._attn_implementation) == (torch.bfloat16, attention)
    assert (plain.dtype, plain.config._attn_implementation) == (torch.bfloat16, attention)
    assert {p.dtype for p in model.parameters()} == {p.dtype for p in plain.parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_ep1_matches_from_pretrained(family, checkpoints, artifact_dir):
    from hp_rewrite import rewrite

    model, report = load_expert_parallel(
        checkpoints[family], DEFAULT_PLAN, ExpertParallelGroup.single(), artifact_dir
    )
    ref = _reference(checkpoints[family])
    assert not model.training
    # transformers' defaults: the checkpoint's dtype, its attention choice (sdpa where the model has it)
    assert (model.dtype, model.config._attn_implementation) == (ref.dtype, ref.config._attn_implementation)
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    ref_buffers = dict(ref.named_buffers())  # non-persistent ones (rotary inv_freq) re-initialised
    assert [n for n, b in model.named_buffers() if not torch.equal(b, ref_buffers[n])] == []
    assert [
        n for n, p in model.named_parameters() if p.requires_grad != ref.get_parameter(n).requires_grad
    ] == []
    if ref.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report["patched"] and report["expert_bytes"] > 0 and report["non_expert_bytes"] > 0
    assert report["bytes_read"] == _checkpoint_bytes(checkpoints[family])
    _fresh(model)

    ids = sample_input_ids(model.config)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        unmodified = ref(input_ids=ids).logits
        analysis = rewrite.analyze(ref, DEFAULT_PLAN)
        artifact = rewrite.write(analysis, DEFAULT_PLAN, ref.config, artifact_dir)
        rewrite.install(ref, artifact, DEFAULT_PLAN, ExpertParallelGroup.single())
        rewritten = ref(input_ids=ids).logits
    assert torch.equal(logits, rewritten)
    assert _rel(logits, unmodified) <= 1e-6


def test_missing_and_unexpected_keys_are_named(checkpoints, artifact_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoints["mixtral"]
    state = load_file(src / "model.safetensors")
    state.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    state.pop("model.norm.weight")
    state["model.layers.0.block_sparse_moe.surprise.weight"] = torch.zeros(2)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointKeyError) as e:
        load_expert_parallel(bad, DEFAULT_PLAN, ExpertParallelGroup.single(), artifact_dir)
    msg = str(e.value)
    assert "model.norm.weight" in msg and "block_sparse_moe.surprise.weight" in msg, msg

    state = load_file(src / "model.safetensors")
    state.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointKeyError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj.*missing 3"):
        load_expert_parallel(bad, DEFAULT_PLAN, ExpertParallelGroup.single(), artifact_dir)


# ----------------------------------------------------------------------------------------------
# EP=2 on two gloo ranks


def _balanced_plan(model, ep_size: int):
    """A plan placing each block's experts by a skewed made-up load, so no rank owns consecutive experts."""
    from hp_rewrite.match import find_blocks

    loads = {s.path: [((7 * e) % 5 + 1) * (e % 2 * 10 + 1) for e in range(s.num_experts)] for s in find_blocks(model)}
    return parse_plan(f"version: 1\nep_size: {ep_size}\nplacement:\n  strategy: balanced\n  loads: {json.dumps(loads)}\n")


def ep2_rank(rank: int, world: int, payload: dict) -> dict:
    """Per family: load with only the local experts, compare with the full model (see module doc)."""
    from hp_rewrite.runtime.group.groups import build_expert_parallel_group

    torch.set_num_threads(1)
    ep = build_expert_parallel_group(world)
    out = {}
    for variant, model_dir in [(f, d) for f, d in payload["checkpoints"].items()] + [
        (f"{f}-balanced", payload["checkpoints"][f]) for f in BALANCED
    ]:
        full = _reference(model_dir)
        plan = _balanced_plan(full, world) if variant.endswith("-balanced") else _plan(world)
        model, report = load_expert_parallel(model_dir, plan, ep, payload["artifact_dir"])
        full_state = full.state_dict()
        mismatched, expert_tensors, full_expert_bytes = [], 0, 0
        for name, tensor in model.state_dict().items():
            owner = _expert_owner(model, name)
            want = full_state[name]
            if owner is not None:
                binding, layout = owner
                expert_tensors += 1
                full_expert_bytes += want.numel() * want.element_size()
                assert binding.placement.num_experts == layout.per_expert(want).shape[0]
                want = layout.stored(layout.per_expert(want)[binding.placement.local_index])
            if tensor.shape != want.shape or not torch.equal(tensor, want):
                mismatched.append(name)
        _fresh(model)
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(0, min(vocab, 64), (2 * world, 8), generator=torch.Generator().manual_seed(0))
        mine = slice(2 * rank, 2 * rank + 2)
        with torch.no_grad():
            logits = model(input_ids=ids[mine]).logits
            ref_logits = full(input_ids=ids).logits[mine]
        placements = [installed.binding(m).placement for m in model.modules() if installed.is_holder(m)]
        out[variant] = {
            "contiguous": [p.is_contiguous for p in placements],
            "mismatched": mismatched,
            "expert_tensors": expert_tensors,
            "full_expert_bytes": full_expert_bytes,
            "checkpoint_bytes": _checkpoint_bytes(Path(model_dir)),
            "logits_rel": _rel(logits, ref_logits),
            "report": report,
        }
    return out


_EP2: list = []


def _ep2_world(checkpoints, artifact_dir) -> list[dict]:
    if not _EP2:
        payload = {
            "checkpoints": {k: str(v) for k, v in checkpoints.items()},
            "artifact_dir": str(artifact_dir),
        }
        _EP2.extend(run_world(2, "tests.test_local_load:ep2_rank", payload, timeout=300))
    return _EP2


@pytest.mark.parametrize("family", FAMILIES + [f"{f}-balanced" for f in BALANCED])
def test_ep2_holds_local_slices(family, checkpoints, artifact_dir):
    ranks = _ep2_world(checkpoints, artifact_dir)
    for rank, results in enumerate(ranks):
        r = results[family]
        # the balanced plan spreads the experts (not consecutive blocks), the default keeps blocks
        assert r["contiguous"] and set(r["contiguous"]) == {not family.endswith("-balanced")}
        rep = r["report"]
        assert r["mismatched"] == [], (rank, r["mismatched"])
        assert r["expert_tensors"] > 0
        assert rep["ep_size"] == 2 and rep["ep_rank"] == rank
        assert rep["expert_bytes"] * 2 == r["full_expert_bytes"]
        # the other rank's experts are never read: everything but them, nothing twice
        assert rep["bytes_read"] == r["checkpoint_bytes"] - rep["expert_bytes"]
        assert r["logits_rel"] <= 1e-5, (rank, r["logits_rel"])


# ----------------------------------------------------------------------------------------------
# memory, EP=4 on four gloo ranks

MEMORY_SIZES = {"hidden_size": 256, "num_hidden_layers": 8, "num_experts": 32, "moe_intermediate_size": 256,
                "head_dim": 64, "vocab_size": 1024}  # fmt: skip


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the kernel's resident-set high-water mark (``VmHWM``) of this process (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def memory_rank(rank: int, world: int, payload: dict) -> dict:
    """Peak RSS of one ``load_expert_parallel`` call over the RSS right before it (bytes)."""
    from hp_rewrite.runtime.group.groups import build_expert_parallel_group

    torch.set_num_threads(1)
    ep = build_expert_parallel_group(world)
    # warm-up: one load of a tiny checkpoint of the same family, so the process-wide one-time costs
    # (imports, first use of torch and libcst code paths, caches) are in the baseline, not in the delta
    warm, _ = load_expert_parallel(payload["warmup_dir"], _plan(world), ep, payload["artifact_dir"])
    del warm
    gc.collect()
    reset = _reset_peak()
    baseline_kib = _status_kib("VmRSS")
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model, report = load_expert_parallel(payload["model_dir"], _plan(world), ep, payload["artifact_dir"])
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if reset:
        method, peak_kib = "VmHWM after clear_refs", _status_kib("VmHWM")
    elif maxrss_after > maxrss_before:  # the load set a new high-water mark: it is the load's peak
        method, peak_kib = "ru_maxrss", maxrss_after
    else:  # an earlier peak was higher: only an upper bound of the load's
        method, peak_kib = "ru_maxrss upper bound", maxrss_after
    return {"method": method, "baseline": baseline_kib * 1024, "peak": peak_kib * 1024, "report": report}


def test_peak_memory_is_local_share(tmp_path):
    """Peak resident memory of a rank loading at EP=4 stays within 1.15x its share plus its baseline.

    Method: a Qwen3-MoE checkpoint (hidden 256, 8 layers, 32 experts, expert width 256, fp32; 210 MB,
    experts 96%) is written first. Each of 4 gloo ranks first loads a tiny Qwen3-MoE checkpoint
    (warm-up: imports and the one-time initialisation of torch, transformers and libcst code paths,
    about 15 MB, belong to the process, not to a load), then resets its kernel resident-set
    high-water mark (``echo 5 > /proc/self/clear_refs``, which also
    resets ``getrusage(RUSAGE_SELF).ru_maxrss``), reads its baseline RSS (``VmRSS``), calls
    ``load_expert_parallel`` and reads the high-water mark (``VmHWM``). Where clear_refs is not
    writable, ``ru_maxrss`` is the load's peak if the load raised it; otherwise it is only an
    upper bound, and the test skips if that bound is not enough. Resident memory
    counts the file pages a memory-mapped read touches, so reading the whole checkpoint, or
    keeping the mappings open, would show here. Bound: ``peak - baseline <= 1.15 * (non-expert
    bytes + all expert bytes / 4)``. The analysis that picks the archetypes runs one block of each
    class with random weights, on rank 0 only, with the experts' width narrowed
    (``tests/test_probe.py``), before any weight is loaded.
    """
    from safetensors import safe_open

    if _status_kib("VmRSS") is None:
        pytest.skip("needs /proc/self/status (Linux) to read resident memory")
    cfg = tiny_config("qwen3_moe")
    for key, value in MEMORY_SIZES.items():
        setattr(cfg, key, value)
    model_dir = tmp_path / "memory-ckpt"
    model = build_tiny_model(cfg)
    model.save_pretrained(model_dir)
    del model
    gc.collect()
    expert_total = other_total = 0
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        for k in f.keys():
            n = torch.Size(f.get_slice(k).get_shape()).numel() * 4
            if ".mlp.experts." in k:
                expert_total += n
            else:
                other_total += n
    assert expert_total > 20 * other_total  # experts dominate

    warmup_dir = make_tiny("qwen3_moe", tmp_path / "warmup-ckpt")
    payload = {
        "model_dir": str(model_dir),
        "warmup_dir": str(warmup_dir),
        "artifact_dir": str(tmp_path / "art"),
    }
    ranks = run_world(4, "tests.test_local_load:memory_rank", payload, timeout=300)
    lines = []
    for rank, r in enumerate(ranks):
        rep = r["report"]
        assert rep["expert_bytes"] == expert_total // 4
        share = rep["non_expert_bytes"] + rep["expert_bytes"]
        used = r["peak"] - r["baseline"]
        lines.append(
            f"rank {rank}: peak-baseline {used / 2**20:.1f} MiB, share {share / 2**20:.1f} MiB, "
            f"ratio {used / share:.3f} ({r['method']})"
        )
        if used > MEMORY_SLACK * share and r["method"] == "ru_maxrss upper bound":
            pytest.skip(
                "cannot reset the RSS high-water mark here (/proc/self/clear_refs) and an earlier "
                "peak hides the load's: " + lines[-1]
            )
        assert used <= MEMORY_SLACK * share, "\n".join(lines)
    print("\n".join(lines))
    print(json.dumps({"expert_total": expert_total, "other_total": other_total}))
