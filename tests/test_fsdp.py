"""hp_rewrite.fully_shard: FSDP2 with the experts sharded over the expert-replica mesh and the other
weights over data parallel, against the unmodified model on the concatenated batch (real gloo
worlds of 2 and 4 ranks); device meshes; and what does not compose with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hp_rewrite.launch import run_world
from tests.fsdp_cases import BALANCED
from tests.missing_experts_cases import _without
from tests.training_cases import TOL

BF16_TOL = 2e-2  # relative; the unmodified model under the same MixedPrecisionPolicy (measured 4.5e-3)

CASES = {  # id: (world, payload)
    # SGD at lr 1: a gradient off by any factor moves the weights by it; clipped with hp_rewrite.clip_grad_norm_
    "ep2-sgd-lr1-clip": (2, {"ep_size": 2, "steps": 2, "optimizer": "sgd", "max_norm": 0.5}),
    # EP=2 x 2 expert replicas: experts Shard(0) over efsdp=2, divided by the world size
    # (then saved, one layer at a time, and loaded by plain transformers)
    # (balanced: the lent experts' weights gathered from their shards, their gradients reduce-scattered back)
    "ep2xefsdp2-adamw-clip-balanced": (4, {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3,
                                           "max_norm": 1.0, "save": True, "plan": BALANCED}),
    # 3 local experts over 2 replicas: Shard(1), no padded dim 0; the experts-level rewrite (the holder called
    # with tensors, so FSDP2 hooks its inputs) balanced with activation checkpointing: the lent gradients
    # still reach the owner's shard
    "ep2xefsdp2-shard1-experts-level-balanced": (4, {"ep_size": 2, "steps": 1, "optimizer": "sgd", "max_norm": 0.5,
                                                     "num_experts": 6, "checkpointing": True,
                                                     "plan": "archetype:\n  level: experts\n" + BALANCED}),
    # the user's ("dp_replicate", "efsdp", "ep") mesh: EP groups from it, HSDP for experts and the rest;
    # runtime.balance forced on (any imbalance, any piece): a lent expert's weights are its replica's
    "mesh-dp_replicate2-ep2-balanced": (4, {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3,
                                            "max_norm": 1.0, "mesh": [2, 1, 2], "plan": BALANCED}),
    # flat [E*I, H] expert weights (DBRX) and zero-computation experts kept on every rank (LongCat-Flash),
    # experts sharded over 2 replicas
    "ep2xefsdp2-dbrx-adamw-clip": (4, {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3, "max_norm": 1.0,
                                       "model_type": "dbrx", "save": True}),
    "ep2xefsdp2-longcat_flash-adamw-clip": (4, {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3,
                                                "max_norm": 1.0, "model_type": "longcat_flash", "save": True}),
    # activation checkpointing composes (balanced: the recomputation lends again, the same decision)
    "ep2-checkpointing-balanced": (2, {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3, "max_norm": 1.0,
                                       "checkpointing": True, "plan": BALANCED}),
}


# bf16 parameters (FSDP2's param_dtype), fp32 reduction; runtime.balance on with 2 chunks
MIXED = {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3, "max_norm": 1.0, "bf16": True,
         "plan": "runtime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1, chunks: 2}\n"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Every fsdp_training case, all the cases of one world size in one world: {case: [rank results]}."""
    out, results = tmp_path_factory.mktemp("fsdp"), {}
    cases = {**CASES, "mixed-precision": (2, MIXED)}
    for world in sorted({w for w, _ in cases.values()}):
        mine = {name: payload for name, (w, payload) in cases.items() if w == world}
        ranks = run_world(world, "tests.fsdp_cases:fsdp_training_cases", {"cases": mine, "out_dir": str(out)},
                          timeout=900)
        results.update({name: [r[name] for r in ranks] for name in mine})
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_fully_shard_steps_equal_unmodified(case: str, trained: dict) -> None:
    world, payload = CASES[case]
    for rank, r in enumerate(trained[case]):
        assert r["grad_worst"] <= TOL, (rank, r["grad_worst_name"], r["grad_worst"])
        assert r["worst"] <= TOL, (rank, r["worst_name"], r["worst"])
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), r  # every parameter once
        assert r["dense_mesh"] == world and r["expert_mesh"] == world // payload["ep_size"], r
        assert r["mesh_is_users"], r
        if payload.get("save") and rank == 0:
            assert r["saved_worst"] <= TOL and r["saved_equals_dense"], r
        if payload.get("save"):  # checkpoint_weights streams what save_pretrained wrote (#46)
            assert not r["stream_problems"], (rank, r["stream_problems"])
        if BALANCED in payload.get("plan", ""):
            assert r["guests"] > 0, r  # rows really moved
        if payload.get("num_experts"):
            assert r["expert_placement"] == "S(1)", r
        elif world > 2 and "mesh" not in payload and "model_type" not in payload:
            assert r["expert_local_shape"][0] == 8 // payload["ep_size"] // 2, r  # experts sharded over replicas


PEFT_CASES = {  # id: (world, payload)
    # LoRA on attention and on the experts, activation checkpointing, AdamW with clipping
    "ep2-attention-and-experts-adamw": (2, {"ep_size": 2, "checkpointing": True}),
    # adapters on the experts only, sharded over 2 expert replicas; SGD at lr 1 (any gradient factor shows)
    # (balanced: a lent expert carries its adapter, whose gradient returns to the owner's adapter shard)
    "ep2xefsdp2-experts-only-sgd-lr1-balanced": (4, {"ep_size": 2, "experts_only": True, "optimizer": "sgd",
                                                     "lr": 1.0, "plan": BALANCED}),
}


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_fully_shard_trains_saves_and_loads_peft_adapters_on_the_experts(case: str, tmp_path: Path) -> None:
    world, payload = PEFT_CASES[case]
    results = run_world(world, "tests.fsdp_cases:peft_fsdp", {**payload, "out_dir": str(tmp_path)})
    for rank, r in enumerate(results):
        assert r["local_adapters"] == 8 and r["trainable"] == (8 if payload.get("experts_only") else 16), r
        assert r["grad_worst"] <= TOL, (rank, r["grad_worst_name"], r["grad_worst"])
        assert r["worst"] <= TOL, (rank, r["worst_name"], r["worst"])
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), r  # every adapter once
        # the expert adapters sharded with their frozen experts: over the expert replicas, not the world
        assert r["adapter_mesh"] == world // 2 and r["adapter_local_rows"] == r["adapter_rows"] // (world // 2), r
        assert r["file_keys"] and r["file_worst"] <= TOL, r  # peft save_pretrained: plain PEFT's file
        assert r["loaded_worst"] == 0.0 and r["loaded_sharded"], r  # load_adapter of plain PEFT's file, exactly
        assert "PEFT adapters" in r["dcp_refused"] and "save_pretrained" in r["dcp_refused"], r
        assert not r["stream_problems"], (rank, r["stream_problems"])  # merged weights streamed (#46)
        if payload.get("plan") == BALANCED:
            assert r["guests"] > 0, r
            # the frozen experts travel with their adapters' factors, and only the factors' gradients return
            assert r["lent_grad_bytes"] * 4 < r["lent_bytes"] or r["lent_bytes"] == 0, r
    if payload.get("plan") == BALANCED:
        assert sum(r["lent_bytes"] for r in results) > 0, results


def test_fully_shard_mixed_precision_within_bf16_tolerance(trained: dict) -> None:
    """bf16 parameters (FSDP2's param_dtype), fp32 reduction; runtime.balance on with 2 chunks: the weights
    lent in bf16, once per layer (FSDP2's mixed precision copies the call's dataclasses: the chunks still
    share one lending, whose bytes are counted)."""
    results = trained["mixed-precision"]
    for rank, r in enumerate(results):
        assert r["grad_worst"] <= BF16_TOL, (rank, r["grad_worst_name"], r["grad_worst"])
        assert r["worst"] <= BF16_TOL, (rank, r["worst_name"], r["worst"])
        assert r["guests"] > 0, r
    assert sum(r["lent_bytes"] for r in results) > 0, results


def test_fully_shard_refuses_what_does_not_compose(tmp_path: Path) -> None:
    from hp_rewrite.tiny import make_tiny

    payload = {"out_dir": str(tmp_path), "model_dir": str(make_tiny("qwen3_moe", tmp_path / "m"))}
    for r in run_world(2, "tests.fsdp_cases:fsdp_refusals", payload):
        assert r["mesh_from_pretrained"] and r["mesh_auto_patch"], r  # the user's mesh, through loading
        assert "defer_expert_grads: false" in r["deferred"], r
        assert "runtime.balance: auto" in r["balance_flat"] and "flat" in r["balance_flat"], r
        assert "remove the sync_gradients call" in r["sync_gradients"], r
        assert "remove the gradient_sync call" in r["gradient_sync"], r
        assert "mesh" in r["torch_clip"], r  # torch's own clip refuses two meshes: hp_rewrite.clip_grad_norm_
        assert "FSDP2 does not support" in r["interleaver"], r
        for key in ("mesh_fsdp", "mesh_rewrite"):
            assert "ep_size=2 (the plan)" in r[key], (key, r)
        assert "'ep' last" in r["mesh_order"], r


def test_deepseek_v3_dry_run_at_world_256(tmp_path: Path) -> None:
    """The real DeepSeek-V3 config (61 layers, 256 experts) on the meta device, rewritten and sharded
    as a few ranks of a fake world of 256 (EP 64 x efsdp 4 and EP 32 x efsdp 8): every shard has the
    shape FSDP2 cuts and each rank holds 1/256 of the 671 B parameters. tools/fsdp_dry_run.py checks
    every rank (docs/BENCHMARKS.md)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "dry.json"
    run = subprocess.run([sys.executable, str(root / "tools" / "fsdp_dry_run.py"), "--world", "256", "--ep", "64", "32",
                          "--ranks", "0", "255", "--artifacts", str(tmp_path / "art"), "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for layout, r in json.loads(out.read_text()).items():
        assert r["ranks_checked"] == 2 and not r["bad_shapes"], (layout, r)
        assert 670e9 < r["params"] < 672e9, r
        assert r["max_bytes"] <= 1.01 * r["ideal_bytes"], (layout, r)  # FSDP2's padding aside, 1/world each


def test_training_memory_per_rank_is_one_world_share() -> None:
    """tools/measure_train_memory.py at a small size: with fully_shard each rank holds
    (non-expert + expert parameters) / world x 16 bytes of weights, gradients and AdamW state
    (within 10%); replicated, every rank holds every non-expert weight."""
    payload = {"ep": 2, "hidden": 128, "layers": 2, "experts": 8, "moe_intermediate": 64, "vocab": 4096, "seq": 16,
               "batch": 2, "artifacts": "/tmp/hp-rewrite-train-memory-test"}
    for r in run_world(4, "tools.measure_train_memory:worker", payload):
        sharded, replicated = r["fully_shard"], r["replicated"]
        assert abs(sharded["total"] / r["target_fully_shard"] - 1) <= 0.10, r
        assert abs(replicated["total"] / r["target_replicated"] - 1) <= 0.10, r
        assert sharded["total"] < replicated["total"] / 2, r


DCP_CASES = {  # id: (ep, sharded) when saved; loads: (ep, sharded, over a (dp_replicate, efsdp, ep) mesh)
    "saved-ep2-sharded": ((2, True), [(2, True, False), (4, True, False)]),
    "saved-ep4-sharded": ((4, True), [(2, True, True)]),
    "saved-ep2-ddp": ((2, False), [(4, True, False)]),
    "dbrx-saved-ep2-ddp": ((2, False), [(4, True, False)], "dbrx"),  # flat [E*I, H] experts: rows, not experts
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """Every DCP case in one 4-rank world: {case: rank 0's result}."""
    cases = {}
    for case, ((ep_save, shard_save), loads, *model_type) in DCP_CASES.items():
        cases[case] = {"ep_save": ep_save, "shard_save": shard_save, "loads": loads,
                       "model_type": (model_type or ["qwen3_moe"])[0]}
    payload = {"cases": cases, "out_dir": str(tmp_path_factory.mktemp("dcp"))}
    return run_world(4, "tests.fsdp_cases:dcp_resume_cases", payload, timeout=900)[0]


@pytest.mark.parametrize("case", list(DCP_CASES))
def test_distributed_checkpoint_resumes_at_the_same_and_another_ep_size(case: str, resumed: dict) -> None:
    """Save model + AdamW after one step, load into a fresh model and optimizer, take the second
    step: the weights equal the uninterrupted run's (bit for bit at the same EP size; at another the
    gradients are summed in another order)."""
    (ep_save, _), loads, *_ = DCP_CASES[case]
    r = resumed[case]
    assert r["moved"] > 1e-3, r  # the steps changed every weight: the comparison means something
    for (ep, _, _), worst in zip(loads, r["worst"], strict=True):
        assert worst <= (0.0 if ep == ep_save else TOL), (ep, r)


def test_fully_sharded_load_reads_only_each_ranks_share(tmp_path: Path) -> None:
    """hp_rewrite.load_fully_sharded at EP=2 x 2 replicas: every shard is the checkpoint's, each rank
    reads its final bytes and no more (dense tensors by rows, experts by their shard's experts), and
    the load's peak RSS stays within 1.15x of them (measured 1.04; 141 MB checkpoint, 37 MB a rank). RSS over the RSS before the call, after a warm-up load and the artifact's analysis."""
    from hp_rewrite.tiny import build_tiny_model, make_tiny, tiny_config

    cfg = tiny_config("qwen3_moe")
    for key, value in {"hidden_size": 256, "num_hidden_layers": 16, "num_experts": 8, "moe_intermediate_size": 256,
                       "head_dim": 64, "vocab_size": 16384}.items():
        setattr(cfg, key, value)
    model_dir = tmp_path / "ckpt"
    build_tiny_model(cfg).save_pretrained(model_dir)
    total = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    # what the checkpoint lacks (#44): layer 1's routed experts, layer 0's expert down projections and a
    # dense weight, drawn as plain transformers draws them (this rank's FSDP2 shard of its experts' rows)
    warm = make_tiny("qwen3_moe", tmp_path / "warm")
    missing = tmp_path / "missing"
    _without(warm, missing, lambda k: k.startswith("model.layers.1.mlp.experts.") or k == "model.layers.0.self_attn.q_proj.weight"
             or (k.startswith("model.layers.0.mlp.experts.") and k.endswith(".down_proj.weight")))
    payload = {"model_dir": str(model_dir), "warmup_dir": str(warm), "out_dir": str(tmp_path), "ep_size": 2,
               "missing_dir": str(missing)}
    for rank, r in enumerate(run_world(4, "tests.fsdp_cases:sharded_load", payload)):
        assert r["worst"] == 0.0 and r["logits"] <= 1e-5, (rank, r)
        assert r["missing_worst"][0] == 0.0 and r["missing_stream"], (rank, r)
        assert r["peak"] <= 1.15 * r["final"], (rank, r)
        assert r["read"] <= 1.01 * r["final"] < total / 3, (rank, r, total)  # its share, not the model
