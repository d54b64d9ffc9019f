"""Tensor and sequence parallelism with the TP-extended EP group, against the unmodified model.

One gloo world of 4 ranks runs every case (tp x dp with EP 2 and 4, tp 4 with EP 4, with and without
sequence parallelism; qwen3_moe, deepseek_v3 with MLA and an additive shared expert, qwen2_moe with a
gated one): logits and every gradient after ``sync_gradients``, fp32 within 1e-5 of the largest
reference value, bf16 within 3e-2 (the EP parity tests' bf16 tolerance). A doubled reduction of the
shared expert's output is caught, and what cannot be split is refused with the reason.
"""

from __future__ import annotations

import pytest

from hp_rewrite.launch import run_world
from tests.missing_experts_cases import write_checkpoints
from tests.tp_cases import TOL
from tests.weights_cases import weights_payload

BF16_TOL = 3e-2
LAYOUTS = [(2, 2), (4, 2), (4, 4)]  # (ep_size, tp_size) on 4 ranks: tp2 x dp2 with EP 2 and 4, tp4 with EP 4
CASES = [dict(id=f"{m}-ep{e}-tp{t}" + ("-sp" if sp else ""), model_type=m, ep=e, tp=t, sp=sp)
         for m in ("qwen3_moe", "deepseek_v3", "qwen2_moe") for e, t in LAYOUTS for sp in (False, True)]
# more families, one layout each: per-head norms after the head transpose (HunYuan), an additive shared
# expert with GQA (GLM-4.5), no shared expert and no head norms (Mixtral)
CASES += [dict(id=f"{m}-ep{e}-tp2-sp", model_type=m, ep=e, tp=2, sp=True)
          for m, e in (("hunyuan_v1_moe", 4), ("glm4_moe", 4), ("mixtral", 2))]
# a TP group wider than the EP group: TP alone (EP 1, every rank all experts), and tp 4 over two EP groups
CASES += [dict(id="qwen3_moe-ep1-tp2-sp", model_type="qwen3_moe", ep=1, tp=2, sp=True),
          dict(id="qwen2_moe-ep2-tp4", model_type="qwen2_moe", ep=2, tp=4, sp=False)]
EXTRA = [dict(id="bf16-qwen2_moe-ep4-tp2-sp", model_type="qwen2_moe", ep=4, tp=2, sp=True, bf16=True),
         dict(id="doubled-shared-reduction", model_type="deepseek_v3", ep=2, tp=2, sp=False, double_shared=True),
         dict(id="user-mesh", model_type="qwen3_moe", ep=4, tp=2, sp=True, user_mesh=True)]
# runtime.balance forced on (any imbalance, any piece moves) over the TP-extended EP group, with and
# without sequence parallelism (#61)
BALANCED = [dict(id="balanced-qwen3_moe-ep4-tp2", model_type="qwen3_moe", ep=4, tp=2, sp=False, balance=True),
            dict(id="balanced-deepseek_v3-ep2-tp2-sp", model_type="deepseek_v3", ep=2, tp=2, sp=True, balance=True)]
EXTRA += BALANCED
REFUSALS = [dict(id="kv-heads", model_type="qwen3_moe", ep=4, tp=4, sp=False, kv_heads=2),
            dict(id="odd-sequence", model_type="qwen3_moe", ep=2, tp=2, sp=True, seq=7),
            dict(id="ddp", model_type="qwen3_moe", ep=2, tp=2, sp=False, engine="ddp"),
            dict(id="trainer", model_type="qwen3_moe", ep=2, tp=2, sp=False, engine="trainer"),
            dict(id="batch-per-rank", model_type="qwen3_moe", ep=2, tp=2, sp=False, engine="batch_per_rank"),
            dict(id="rows-swapped", model_type="qwen3_moe", ep=2, tp=2, sp=False, engine="rows_swapped"),
            dict(id="attentions", model_type="qwen3_moe", ep=2, tp=2, sp=False, engine="attentions"),
            dict(id="hidden-states", model_type="qwen3_moe", ep=2, tp=2, sp=True, engine="hidden_states"),
            dict(id="mesh-order", model_type="qwen3_moe", ep=2, tp=2, sp=False, mesh=((2, 2), ("tp", "dp"))),
            dict(id="mesh-size", model_type="qwen3_moe", ep=2, tp=2, sp=False, mesh=((1, 4), ("dp", "tp")))]

# experts the checkpoint lacks (#44): every family at EP 4, and TP-extended EP (tp 2 x EP 2 and 4)
MISSING_PLANS = [{"ep": 4}, {"ep": 2, "tp": 2, "only": ["qwen3_moe-layer", "deepseek_v3-projection"]},
                 {"ep": 4, "tp": 2, "only": ["qwen3_moe-layer"]}]
# checkpoint_weights (#46): every family and LoRA merged at EP 4, TP-extended EP (tp 2 x EP 2 and 4)
WEIGHTS_PLANS = [{"ep": 4, "peft": True}, {"ep": 2, "tp": 2, "only": ["qwen3_moe", "deepseek_v3"]},
                 {"ep": 4, "tp": 2, "only": ["qwen3_moe"]}]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    memory = {"ep": 2, "tp": 2, "hidden": 128, "layers": 2, "experts": 8, "moe_intermediate": 64, "vocab": 256,
              "seq": 256, "batch": 2, "artifacts": str(out / "memory")}
    missing = {**write_checkpoints(out / "missing"), "out_dir": str(out / "missing"), "plans": MISSING_PLANS}
    weights = weights_payload(out / "missing", out / "weights", WEIGHTS_PLANS)
    payload = {"cases": CASES + EXTRA, "refusals": REFUSALS, "out_dir": str(out), "memory": memory, "missing": missing,
               "weights": weights}
    return run_world(4, "tests.tp_cases:tp_world", payload, timeout=900)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_tp_ep_equals_unmodified(world, case) -> None:
    for rank, results in enumerate(world):
        r = results[case["id"]]
        assert r["logits"] <= TOL, f"rank {rank}: logits off by {r['logits']:.2e}"
        assert r["grad"] <= TOL, f"rank {rank}: gradient of {r['grad_name']} off by {r['grad']:.2e}"
        assert r["dtensors"] > 0  # the dense parts really are split


@pytest.mark.parametrize("case", BALANCED, ids=[c["id"] for c in BALANCED])
def test_balancing_over_the_tp_extended_ep_group(world, case) -> None:
    """Each TP rank's share of its group's tokens is balanced over the EP group like any rank's rows."""
    for rank, results in enumerate(world):
        r = results[case["id"]]
        assert r["logits"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["moved"] > 0, (rank, r)  # rows really moved


def test_the_users_mesh(world) -> None:
    """A ("dp", "tp") mesh of the user's is used as it is; one that does not fit the plan is refused."""
    for rank, results in enumerate(world):
        r = results["user-mesh"]
        assert r["logits"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert "'tp' last" in results["mesh-order"], results["mesh-order"]
        assert "tp_size=2" in results["mesh-size"] and "4 ranks" in results["mesh-size"], results["mesh-size"]


def test_bf16_within_tolerance(world) -> None:
    for rank, results in enumerate(world):
        r = results["bf16-qwen2_moe-ep4-tp2-sp"]
        assert r["logits"] <= BF16_TOL and r["grad"] <= BF16_TOL, (rank, r)


def test_a_doubled_shared_reduction_is_caught(world) -> None:
    """The shared expert is a nested TP boundary that reduces its own output; reducing it again (what a
    caller must not do) doubles it, and the comparison sees it."""
    for results in world:
        r = results["doubled-shared-reduction"]
        assert r["logits"] > 100 * TOL and r["grad"] > 100 * TOL, r


def test_refusals_name_the_reason(world) -> None:
    for results in world:
        assert "num_key_value_heads=2" in results["kv-heads"] and "tp_size 4" in results["kv-heads"]
        assert "sequence length 7" in results["odd-sequence"] and "sequence_parallel" in results["odd-sequence"]
        # engines that would treat the ranks of a TP group as separate batches or average TP shards; a Trainer
        # that does not see the world (built without torchrun's environment) cannot give each TP group one batch
        assert "DistributedDataParallel" in results["ddp"] and "sync_gradients" in results["ddp"]
        assert "prepare_trainer" in results["trainer"] and "tp_size" in results["trainer"]
        # a sampler over the world (each rank its own batch) would train on a mix: caught at the first forward
        assert "different batches" in results["batch-per-rank"] and "rank // tp_size" in results["batch-per-rank"]
        assert "different orders" in results["rows-swapped"], results["rows-swapped"]  # the same rows, reordered
        # outputs a rank holds only its share of
        assert "output_attentions" in results["attentions"] and "heads" in results["attentions"]
        assert "output_hidden_states" in results["hidden-states"] and "chunk" in results["hidden-states"]


def test_sequence_parallel_keeps_a_chunk_of_the_activations(world) -> None:
    """tools/measure_train_memory.py --tp at a small size: with sequence parallelism the decoder norms
    save 1/tp of their activations, and attention and the MoE block keep only this rank's chunk of their
    gathered input for backward (about 1/tp of what EP alone saves, as at tp without SP)."""
    for rank, results in enumerate(world):
        r = results["memory"]
        ep, tp, sp = (r[m]["saved"] for m in ("ep", "tp", "tp+sp"))
        assert abs(sp["norms"] / ep["norms"] - 0.5) < 0.01, (rank, r)
        for part in ("attention", "moe"):
            assert sp[part] <= tp[part] * 1.01 and sp[part] / ep[part] < 0.65, (rank, part, r)
        assert r["tp+sp"]["total"] < r["tp"]["total"] < r["ep"]["total"], (rank, r)


def test_missing_experts_at_ep4_and_with_tp_drawn_as_transformers_draws_them(world) -> None:
    """Experts the checkpoint lacks or mismatches (per-expert, fused, module-list, remote-code checkpoints;
    a layer, a projection, a wider expert, a question-answering head): every tensor bit-equal to this rank's
    rows of plain transformers' draw, the same loading info and log lines, the ranks' experts different;
    a non-per-tensor ``_init_weights`` refused by name (tests/missing_experts_cases.py)."""
    for rank, results in enumerate(world):
        r = results["missing"]
        assert not r["problems"], f"rank {rank}: {r['problems']}"
        assert r["drawn"] >= 40, r  # random expert tensors compared on this rank


def test_checkpoint_weights_streams_what_save_pretrained_writes(world) -> None:
    """``checkpoint_weights`` at EP 4 (every family: per-expert, fused, module and remote-code experts;
    LoRA on attention and experts merged) and with TP-extended EP: name for name and bit for bit what
    plain transformers' save_pretrained writes, to every rank and to one, expert rows in buckets
    (tests/weights_cases.py)."""
    for rank, results in enumerate(world):
        r = results["weights"]
        assert not r["problems"], f"rank {rank}: {r['problems']}"
        assert len(r["checked"]) == 6 + 1 + 2 + 1, r
