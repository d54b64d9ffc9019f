"""FSDP2 through the engines users launch (accelerate's FSDP2 plugin, Trainer and TRL's SFTTrainer with
``fsdp_config`` version 2) on an expert-parallel model: forced onto accelerate's real FSDP2 path on a
CPU, asserted to come back as FSDP2 with the experts over the expert-replica mesh, and compared with
the unmodified model (tests/fsdp_engine_script.py). Two torchrun worlds: EP=2 on 2 ranks, EP=2 x 2
expert replicas on 4 (which also runs the DDP Trainer's LoRA case at EP 2 x 2 data-parallel replicas)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hp_rewrite.tiny import make_tiny
from tests.agreement import assert_logs_agree
from tests.training_cases import TOL, assert_routing_logged

ROOT = Path(__file__).resolve().parent.parent
TWO_RANKS = ["accelerate", "accelerate_sgd", "accelerate_presharded", "trainer_sgd", "trainer_full",
             "trainer_sharded", "sft", "sft_sgd", "sft_bf16", "trainer_lora_experts", "trainer_lora_fp8_kept", "sft_lora_bf16", "accelerate_lora",
             "accelerate_lora_presharded", "grpo", "grpo_lora", "refusals"]
FOUR_RANKS = ["accelerate", "accelerate_sgd", "trainer_sgd", "trainer_full", "sft", "sft_sgd", "trainer_lora_experts",
              "accelerate_lora", "ddp_trainer_lora", "trainer_global_aux", "context_sft", "context_accelerate",
              "context_accelerate_refusal", "context_grpo", "context_sft_fsdp", "context_grpo_vllm", "tp_sft",
              "tp_accelerate", "tp_grpo", "tp_cp_sft"]
SFT_BF16_TOL = 1e-2  # relative, against SFTTrainer on the unmodified model under the same policy (measured 1.9e-3)
# bf16 LoRA: an adapter PEFT starts at zero (lora_B) is about lr * sign(gradient) after Adam's first steps,
# so a gradient entry near zero whose bf16 rounding differs moves it by up to lr: measured 1.8e-2 on an
# attention lora_B (the expert adapters, drawn non-zero: 3.9e-4, held to SFT_BF16_TOL)
LORA_BF16_TOL = 5e-2


def _world(nproc: int, cases: list[str], tmp_path_factory) -> dict:
    model = make_tiny("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "m")
    out = tmp_path_factory.mktemp(f"fsdp_engines{nproc}")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         str(ROOT / "tests" / "fsdp_engine_script.py"), str(model), str(out), *cases],
        capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-12000:]
    return {c: [json.loads((out / f"{c}-rank{r}.json").read_text()) for r in range(nproc)] for c in cases}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    return _world(2, TWO_RANKS, tmp_path_factory)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict:
    return _world(4, FOUR_RANKS, tmp_path_factory)


def _sharded_as_fully_shard(r: dict, world: int) -> None:
    """accelerate really took its FSDP2 path, and the experts are over the expert-replica mesh."""
    assert r["is_fsdp"] and r["fsdp2"] and r["class"].startswith("FSDP"), r
    assert r["dense_mesh"] == world and r["expert_mesh"] == world // 2, r
    assert r["expert_local_rows"] == 8 // 2 // (world // 2), r  # this EP rank's 4 experts, sharded over replicas


def _exact(r: dict) -> None:
    assert r["worst"] <= TOL, (r["worst_name"], r["worst"])
    reported = r.get("grad_norm") or r.get("norms")
    assert reported == pytest.approx(r["ref_norms"], rel=1e-5), r  # every expert once, on every rank


@pytest.mark.parametrize("world", [2, 4])
def test_accelerate_fsdp2_equals_unmodified_and_resumes(world: int, request) -> None:
    for r in request.getfixturevalue({2: "two", 4: "four"}[world])["accelerate"]:
        _sharded_as_fully_shard(r, world)
        _exact(r)
        assert r["resume_worst"] == 0.0, r  # load_state, then the same steps: bit for bit
        assert "hp_rewrite_model_0" in r["state_files"], r
    r0 = request.getfixturevalue({2: "two", 4: "four"}[world])["accelerate"][0]
    assert r0["saved_keys_equal"] and r0["saved_worst"] <= TOL and r0["state_dict_worst"] == 0.0, r0


@pytest.mark.parametrize("world", [2, 4])
def test_accelerate_fsdp2_sgd_step_equals_unmodified(world: int, request) -> None:
    """runtime.balance forced on (every layer lends rows): the lent experts' weights are the ones FSDP2
    gathered, their gradients reduced into the owner's shard (#61)."""
    for r in request.getfixturevalue({2: "two", 4: "four"}[world])["accelerate_sgd"]:
        _sharded_as_fully_shard(r, world)
        _exact(r)
        assert r["lent_or_guests"] > 0, r


@pytest.mark.parametrize("world", [2, 4])
def test_trainer_fsdp2_sgd_step_equals_unmodified(world: int, request) -> None:
    results = request.getfixturevalue({2: "two", 4: "four"}[world])["trainer_sgd"]
    for r in results:
        _sharded_as_fully_shard(r, world)
        _exact(r)
        assert "CheckpointWrapper" in r["layer_class"], r  # fsdp_config's activation checkpointing applied
        assert r["resume_worst"] == 0.0, r  # its checkpoint (layers under the wrapper) read back bit for bit
    assert results[0]["reload_final"] <= TOL, results[0]


@pytest.mark.parametrize("world", [2, 4])
def test_trainer_fsdp2_routing_statistics_equal_a_hand_count(world: int, request) -> None:
    """EP 2 on 2 ranks and EP 2 x 2 replicas on 4: the moe/ logs of each step are the global batch's,
    as a hand count of the unmodified model's routers gives them."""
    for rank, r in enumerate(request.getfixturevalue({2: "two", 4: "four"}[world])["trainer_full"]):
        assert_routing_logged(r, 3, rank)


def test_trainer_fsdp2_global_load_balancing_loss_equals_the_concatenated_batch(four) -> None:
    """routing.aux_loss: global under FSDP2 at EP 2 x 2 replicas with activation checkpointing and gradient
    accumulation: the unmodified model on the concatenated micro-batches of the four ranks."""
    for r in four["trainer_global_aux"]:
        _sharded_as_fully_shard(r, 4)
        assert r["worst"] <= TOL, (r["worst_name"], r["worst"])


@pytest.mark.parametrize("case", ["trainer_full", "trainer_sharded"])
def test_trainer_fsdp2_checkpoints_resume_and_save(case: str, two, request) -> None:
    worlds = {2: two[case], 4: request.getfixturevalue("four")[case]} if case in FOUR_RANKS else {2: two[case]}
    for world, results in worlds.items():
        for r in results:
            _sharded_as_fully_shard(r, world)
            _exact(r)
            assert r["resume_worst"] == 0.0, r  # resumed from checkpoint-1: ends where the run ended, bit for bit
            assert "hp_rewrite_fsdp" in r["files"] and "scheduler.pt" in r["files"], r["files"]
        r0 = results[0]
        assert r0["reload_final"] <= TOL, r0  # save_model writes what plain transformers loads
        if case == "trainer_full":  # FULL_STATE_DICT checkpoints hold the gathered model too, as Trainer's do
            assert "model.safetensors" in r0["files"] and r0["reload_checkpoint"] <= TOL, r0
        else:
            assert "model.safetensors" not in r0["files"], r0["files"]


@pytest.mark.parametrize("world", [2, 4])
def test_sft_trainer_fsdp2_with_its_defaults_equals_unmodified(world: int, request) -> None:
    results = request.getfixturevalue({2: "two", 4: "four"}[world])
    # fp32: three AdamW steps with accumulation 2 and clipping, and one SGD step at lr 1; activation
    # checkpointing and the load-balancing loss as SFTConfig sets them
    for case in ("sft", "sft_sgd"):
        for r in results[case]:
            _sharded_as_fully_shard(r, world)
            assert r["checkpointing"] and r["aux_loss"] and not r["bf16"], r
            _exact(r)
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6), r
            assert r["lent_or_guests"] > 0 or case == "sft", r  # sft_sgd: runtime.balance forced on (#61)
    if world == 2:
        for r in results["sft_bf16"]:  # SFTConfig's defaults: bf16 mixed precision too
            assert r["bf16"] and r["mp_param_dtype"] == "torch.bfloat16" and r["checkpointing"] and r["aux_loss"], r
            assert r["worst"] <= SFT_BF16_TOL, (r["worst_name"], r["worst"])


@pytest.mark.parametrize("world", [2, 4])
def test_trainer_fsdp2_lora_on_the_experts_saves_and_resumes_as_peft(world: int, request) -> None:
    results = request.getfixturevalue({2: "two", 4: "four"}[world])["trainer_lora_experts"]
    for r in results:
        _sharded_as_fully_shard(r, world)
        _exact(r)  # the adapters after three clipped AdamW steps, and the global norm on every rank
        # the expert adapters sharded with their frozen experts: over the expert replicas
        assert r["adapter_mesh"] == world // 2 and r["adapter_rows"] == [8 // (world // 2), 8], r
        assert r["resume_worst"] == 0.0, r  # resumed from checkpoint-1: bit for bit
    r0 = results[0]
    assert r0["reload_final"] == 0.0 and r0["reload_checkpoint-3"] == 0.0, r0  # plain PEFT reads it, bit for bit
    assert {"adapter_model.safetensors", "adapter_config.json", "scheduler.pt"} <= set(r0["files"]), r0["files"]
    assert {f"hp_rewrite_optimizer-rank{i}-of-{world}.pt" for i in range(world)} <= set(r0["files"]), r0["files"]
    assert not any(f.startswith(("model", "hp_rewrite_fsdp", "pytorch_model")) for f in r0["files"]), r0["files"]


def test_ddp_trainer_lora_at_ep2_by_two_replicas(four) -> None:
    """DDP (the Trainer's default), LoRA on attention and the experts, EP 2 x 2 data-parallel replicas:
    each EP rank's adapters trained by two ranks, exact, saved as plain PEFT's, resumed bit for bit."""
    results = four["ddp_trainer_lora"]
    for r in results:
        assert r["wrapped"] == "DistributedDataParallel", r
        _exact(r)
        assert r["resume_worst"] == 0.0, r
    assert results[0]["reload_final"] == 0.0 and results[0]["reload_checkpoint-3"] == 0.0, results[0]


def test_trainer_fsdp2_lora_on_kept_fp8_experts(two) -> None:
    """A DeepSeek-V3 block-FP8 checkpoint, experts kept as codes (FSDP2 leaves them as loaded), LoRA on
    every Linear and the experts, runtime.balance forced on: exact against the dequantised unmodified model,
    resumed bit for bit."""
    results = two["trainer_lora_fp8_kept"]
    for r in results:
        assert r["is_fsdp"] and r["fsdp2"] and r["dense_mesh"] == 2 and r["codes_kept"] > 0, r
        assert r["expert_mesh"] == 0, r  # the kept experts are not DTensors: each rank's codes as read
        assert r["lent_or_guests"] > 0, r  # runtime.balance forced on: codes and factors travelled (#61)
        _exact(r)
        assert r["resume_worst"] == 0.0, r
    assert results[0]["reload_final"] == 0.0 and results[0]["reload_checkpoint-3"] == 0.0, results[0]


@pytest.mark.parametrize("world,case", [(2, "accelerate_lora"), (2, "accelerate_lora_presharded"),
                                        (4, "accelerate_lora")])
def test_accelerate_fsdp2_lora_on_the_experts_equals_unmodified_and_resumes(world: int, case: str, request) -> None:
    results = request.getfixturevalue({2: "two", 4: "four"}[world])[case]
    for r in results:
        _sharded_as_fully_shard(r, world)
        _exact(r)
        assert r["kept"] or case == "accelerate_lora", r  # a model sharded by fully_shard: kept as it is
        assert r["resume_worst"] == 0.0, r  # load_state: adapters and AdamW state put back bit for bit
        assert {"adapter_model.safetensors", *(f"optimizer-rank{i}-of-{world}.pt" for i in range(world))} <= set(
            r["state_files"]), r["state_files"]
    assert results[0]["state_adapter_keys"], results[0]


def test_sft_trainer_fsdp2_lora_with_its_defaults_within_bf16_tolerance(two) -> None:
    for r in two["sft_lora_bf16"]:
        _sharded_as_fully_shard(r, 2)
        assert r["bf16"] and r["checkpointing"] and r["aux_loss"], r
        assert r["experts_worst"] <= SFT_BF16_TOL, r
        assert r["worst"] <= LORA_BF16_TOL, (r["worst_name"], r["worst"])
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-3), r
    assert two["sft_lora_bf16"][0]["reload_final"] == 0.0, two["sft_lora_bf16"][0]


def test_grpo_trainer_fsdp2_equals_unmodified(two) -> None:
    """TRL's GRPOTrainer with fsdp_config version 2, prepared, one step at EP 2 (GRPOConfig's defaults,
    transformers generating in lockstep; fp32) against the unmodified model under the same FSDP2 policy:
    the same completions and logs (floats to rounding: FSDP2 sums the grad norm shard by shard) and the same
    weights after the step (#46). runtime.balance is forced on (every layer lends rows) (#61)."""
    for rank, r in enumerate(two["grpo"]):
        _sharded_as_fully_shard(r, 2)
        assert r["checkpointing"] and r["worst"] <= TOL and r["moved"] > 10 * TOL, (rank, r["worst_name"], r["worst"])
        assert r["lent_or_guests"] > 0, r  # runtime.balance forced on: rows moved
        assert "completions/mean_length" in r["logs"][0] and "grad_norm" in r["logs"][0], r["logs"]
        assert_logs_agree(r["logs"], r["ref_logs"], context=rank)


def test_grpo_trainer_fsdp2_with_lora_equals_unmodified(two) -> None:
    """GRPOTrainer with fsdp_config version 2 and LoRA on attention and the experts (each rank's expert
    adapters its own), one step at EP 2 against the unmodified PEFT model under the same FSDP2 policy:
    the same logs and adapters (fp32; the adapters relative to their largest entry) (#46)."""
    for rank, r in enumerate(two["grpo_lora"]):
        _sharded_as_fully_shard(r, 2)
        assert r["checkpointing"] and r["worst"] <= TOL and r["moved"] > 10 * TOL, (rank, r["worst"], r["moved"])
        assert r["lent_or_guests"] > 0, r  # runtime.balance forced on (#61)
        assert "completions/mean_length" in r["logs"][0], r["logs"]
        assert_logs_agree(r["logs"], r["ref_logs"], context=rank)


def test_accelerate_keeps_a_model_sharded_by_fully_shard(two) -> None:
    for r in two["accelerate_presharded"]:
        assert r["kept"], r  # the same FSDP2 parameters: accelerate did not shard it again
        _sharded_as_fully_shard(r, 2)
        _exact(r)


def test_what_fsdp2_engines_cannot_make_exact_is_refused(two) -> None:
    for r in two["refusals"]:
        assert "prepare_accelerator(accelerator)" in r["unprepared"] and "gate_up_proj" in r["unprepared"], r
        assert "fsdp_version: 2" in r["fsdp1"] and "fsdp_version: 2" in r["trainer_fsdp1"], r
        assert "DeepSpeed (ZeRO)" in r["deepspeed"], r
        assert "meta device" in r["meta"] and "each rank's own experts" in r["meta"], r
        assert "load_best_model_at_end" in r["best_model"], r
        assert "modules_to_save" in r["peft_unsaved"] and "mlp.gate.weight" in r["peft_unsaved"], r
        assert "peft.get_peft_model" in r["add_adapter"], r


@pytest.mark.parametrize("case", ["context_sft", "context_sft_fsdp", "context_accelerate", "context_grpo",
                                  "context_grpo_vllm", "tp_sft", "tp_accelerate", "tp_grpo", "tp_cp_sft"])
def test_context_parallel_through_the_engines_equals_unmodified(case: str, four) -> None:
    """cp_size 2 x 2 data-parallel ranks (tests/context_engines.py): TRL's SFTTrainer (activation checkpointing,
    padding, num_items_in_batch, 2 accumulated micro-batches, clipping; DDP and FSDP2), TRL's GRPOTrainer (sampling with transformers
    or a colocated vLLM engine, each rank's own stream; the training forward's per-token log-probabilities
    of the completion) and a prepared Accelerator's DDP loop (a reduction after every micro-batch)
    against the unmodified model under the same engine fed one batch per context group: the same logs and
    weights; each context group got one batch and the groups different ones; the layers ran on shares.
    ``tp_*``: the same with tp_size 2 instead (TP-extended EP, trained without DDP: the engine guard reduces
    the TP slices), the layers on the whole sequence; ``tp_cp_sft``: tp_size 2 and cp_size 2, one batch on
    all 4 ranks."""
    for rank, r in enumerate(four[case]):
        assert r["worst"] <= TOL and r["moved"] > 10 * TOL, (rank, r["worst_name"], r["worst"], r["moved"])
        partner = four[case][rank ^ 1]  # the other rank of this context group
        other = four[case][(rank + 2) % 4]  # a rank of the other group (of this block's, with tp x cp)
        assert r["ep"]["firsts"][0] == partner["ep"]["firsts"][0], (rank, r["ep"])
        assert (r["ep"]["firsts"][0] == other["ep"]["firsts"][0]) == (case == "tp_cp_sft"), (rank, r["ep"])
        assert r["ep"]["firsts"] == r["ref"]["firsts"], (rank, r["ep"], r["ref"])
        if case in ("tp_sft", "tp_accelerate", "tp_grpo"):
            assert r["ep"]["lengths"][0] == r["ref"]["lengths"][0], (rank, r["ep"], r["ref"])
        else:
            assert r["ep"]["lengths"][0] < r["ref"]["lengths"][0], (rank, r["ep"], r["ref"])  # a share of the sequence
        if case in ("context_sft", "context_sft_fsdp", "tp_sft", "tp_cp_sft"):  # 2 sequences x 2 micro-batches
            assert r["ep"]["total_batch"] == (4 if case == "tp_cp_sft" else 8), r["ep"]  # x 2 groups (or 1)
        if case == "context_sft_fsdp":  # accelerate's real FSDP2 path, over the data x context ranks
            assert r["ep"]["fsdp2"] and r["ref"]["fsdp2"], r
        if case in ("context_sft", "context_sft_fsdp", "context_grpo", "context_grpo_vllm", "tp_sft", "tp_grpo",
                    "tp_cp_sft"):
            assert r["ep"]["checkpointing"], r
            assert_logs_agree(r["ep"]["logs"], r["ref"]["logs"], context=rank)
        else:
            assert r["ep"]["norm"] == pytest.approx(r["ref"]["norm"], rel=1e-6) and r["ep"]["batches"] == 2, r


def test_context_parallel_refusals_name_the_plan_field(four) -> None:
    for r in four["context_accelerate_refusal"]:
        assert "cp_size: 2 in the hp-rewrite plan" in r["message"], r
        assert "FSDP2 through the engine" in r["tp_fsdp"] and "tp_size 2" in r["tp_fsdp"], r
