"""Training engines around a rewritten model, as users set them up: DDP, transformers Trainer,
accelerate, torch.compile and PEFT, each against the unmodified model on real gloo processes; and
every wrapper or call that cannot be exact ends in a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hp_rewrite.launch import run_world
from hp_rewrite.tiny import make_tiny
from tests.agreement import assert_logs_agree
from tests.training_cases import TOL, assert_routing_logged

ROOT = Path(__file__).resolve().parent.parent

BALANCE = "runtime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1}\n"  # forced on: any move

DDP_CASES = {  # id: (world, payload)
    # one SGD step at lr 1 is scale-sensitive: a gradient off by any factor moves the weights by it
    "ep2-sgd-lr1-clip": (2, {"ep_size": 2, "steps": 2, "optimizer": "sgd", "max_norm": 0.5}),
    "ep2-sgd-lr1": (2, {"ep_size": 2, "steps": 1, "optimizer": "sgd"}),
    "ep2xdp2-adamw-accum2-no_sync-clip": (4, {"ep_size": 2, "steps": 3, "optimizer": "adamw", "lr": 1e-3,
                                              "max_norm": 1.0, "accum": 2, "no_sync": True}),
    # DDP synchronising every micro-batch, finding unused parameters, deferred expert gradients
    "ep2-adamw-accum2-find_unused-deferred": (2, {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3,
                                                  "max_norm": 1.0, "accum": 2, "find_unused": True,
                                                  "plan": "runtime: {defer_expert_grads: true}\n"}),
    # activation checkpointing (non-reentrant, as transformers turns it on) inside DDP; runtime.balance forced on:
    # the recomputation makes the forward's decisions, the lent experts' gradients reach DDP's expert sync
    "ep2-sgd-checkpointing-balanced": (2, {"ep_size": 2, "steps": 1, "optimizer": "sgd", "checkpointing": True,
                                           "plan": BALANCE, "routing_logs": True}),
    # the hand-written loop (sync_gradients): clip_grad_norm_ counts each expert once there too; balanced
    # within each EP group, the lent experts' gradients returned before the replicas are summed
    "ep2xdp2-loop-clip-balanced": (4, {"ep_size": 2, "steps": 2, "optimizer": "sgd", "max_norm": 0.5,
                                       "engine": "loop", "plan": BALANCE}),
    # sync_gradients after every micro-batch: the same as once at the end
    "ep2-loop-accum2-sync-each": (2, {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3, "accum": 2,
                                      "max_norm": 1.0, "engine": "loop", "sync_each": True}),
    # Llama 4's block (router score on the experts' input: the input_scaled archetype) inside DDP
    "ep2-llama4_text-sgd-lr1-clip": (2, {"ep_size": 2, "steps": 2, "optimizer": "sgd", "max_norm": 0.5,
                                         "model_type": "llama4_text"}),
    # flat [E*I, H] expert weights in a child of the holder (DBRX) and zero-computation experts (LongCat-Flash)
    "ep2-dbrx-sgd-lr1-clip": (2, {"ep_size": 2, "steps": 2, "optimizer": "sgd", "max_norm": 0.5,
                                  "model_type": "dbrx"}),
    "ep2-longcat_flash-adamw-clip": (2, {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3,
                                         "max_norm": 1.0, "model_type": "longcat_flash"}),
    # the Ascend path (torch_npu stand-in: grouped SwiGLU, k-grouped dW deferred, NPU permute ops) inside DDP
    "ep2-npu-per_slot-deferred-adamw-clip": (2, {"ep_size": 2, "steps": 2, "optimizer": "adamw", "lr": 1e-3,
                                                 "max_norm": 1.0, "npu_standin": True, "plan": (
                                                     "runtime: {compute: npu, dedup: false, defer_expert_grads: true}\n")}),
}


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_steps_equal_unmodified_full_batch(case: str, tmp_path: Path) -> None:
    world, payload = DDP_CASES[case]
    results = run_world(world, "tests.engine_cases:ddp_training", {**payload, "out_dir": str(tmp_path)})
    for rank, r in enumerate(results):
        assert r["grad_worst"] <= TOL, (rank, r["grad_worst_name"], r["grad_worst"])
        assert r["worst"] <= TOL, (rank, r["worst_name"], r["worst"])
        # the global norm: every expert once, every replicated weight once, the same on every rank
        for norm, ref in zip(r["norms"], r["ref_norms"], strict=True):
            assert abs(norm - ref) <= 1e-5 * ref, (rank, r["norms"], r["ref_norms"])
        # replicated weights stay bit-identical across ranks, step after step
        assert all(len(set(d)) == 1 for d in r["digests"]), (rank, r["digests"])
        if payload.get("engine") != "loop":  # one expert reduction per backward that DDP synchronises
            per_step = 1 if payload.get("no_sync") else payload.get("accum", 1)
            assert r["reductions"] == payload["steps"] * per_step, r
        if case.endswith("-balanced"):  # rows did move
            assert sum(x["guests"] for x in results) > 0, [x["guests"] for x in results]
        if payload.get("routing_logs"):  # routing_stats(model).logs(): rows per rank as placed, and as balanced
            layers = [[sum(c) for c in zip(*step_layers, strict=True)] for step_layers in zip(*r["hand_routing"],
                                                                                            strict=True)]
            placed = [max(x) * 2 / sum(x) for x in ([sum(c[: len(c) // 2]), sum(c[len(c) // 2 :])] for c in layers)]
            logs = r["routing_logs"]
            assert logs["moe/rank_imbalance"] == pytest.approx(max(placed), rel=1e-12), (logs, layers)
            for i, value in enumerate(placed):
                assert logs[f"moe/layer_{i}/rank_imbalance"] == pytest.approx(value, rel=1e-12), (logs, layers)
                assert logs[f"moe/layer_{i}/rank_imbalance_balanced"] < value or value == 1.0, logs
        if payload.get("npu_standin"):  # the NPU ops really ran, forward and backward
            calls = r["npu_calls"]
            assert calls["grouped_matmul_k"] > 0 and calls["swiglu_backward"] > 0, calls
            assert calls["token_permute"] > 0 and calls["token_unpermute_backward"] > 0, calls


def test_expert_grad_norms_are_global(tmp_path: Path) -> None:
    for r in run_world(2, "tests.engine_cases:expert_grad_norms", {}):
        assert r["type"] == "ExpertGrad" and r["sum_type"] == "Tensor"
        assert r["vector_norm"] == pytest.approx(r["expected"], rel=1e-6)
        assert r["inf"] == r["expected_inf"] and r["p3"] == pytest.approx(r["expected_p3"], rel=1e-6)
        assert r["foreach"] == pytest.approx([r["expected"][0], 1.0, r["expected"][1]], rel=1e-6)
        assert r["per_row_is_local"] and r["sum_is_local"]
        assert r["clip_total"] == pytest.approx(r["expected_total"], rel=1e-6)


def test_greedy_generate_and_deepcopy_equal_unmodified(tmp_path: Path) -> None:
    """Greedy generate, a deepcopy's too; and completions that end at different steps on the ranks (rank
    0's at once, by EOS): lockstep by default, the unmodified model's tokens, no hang (#46: the timeout
    fails a hang in 4 minutes); synced_gpus=False and continuous batching refused by name."""
    for rank, r in enumerate(run_world(2, "tests.engine_cases:generate_parity", {"out_dir": str(tmp_path)},
                                       timeout=240)):
        assert r["equal"] and r["new_tokens"] == 8, r
        assert r["twin_equal"] and not r["twin_shares_params"] and r["twin_guard_owns_twin"], r  # copy.deepcopy
        assert r["eos_greedy"] and r["eos_greedy_no_cache"] and r["eos_sampling"], r
        assert r["eos_lengths"]["greedy"] == (1 if rank == 0 else 8), r  # rank 0 stopped first: the case holds
        assert "synced_gpus" in r["synced_false"] and "hang" in r["synced_false"], r
        assert "generate_batch" in r["generate_batch"] and "use_transformers_continuous_batching" in r["generate_batch"], r


def test_what_cannot_be_exact_is_refused(tmp_path: Path) -> None:
    for r in run_world(2, "tests.engine_cases:ddp_refusals", {"out_dir": str(tmp_path)}):
        assert "built before" in r["built_before"] and "Rewrite" in r["built_before"], r
        assert "rewrite first" in r["rewrite_wrapped"], r
        assert "rank-local expert parameter" in r["manages_experts"] and "experts.gate_up_proj" in r["manages_experts"]
        assert "remove the sync_gradients call" in r["sync_twice"], r
        assert "Interleaver" in r["interleaver"] and "sync_gradients" in r["interleaver"], r
        for key in ("fsdp2", "fsdp1_origFalse", "fsdp1_origTrue"):
            assert "sharded by FSDP" in r[key] and "gate_up_proj" in r[key], (key, r)
        assert "whole world" in r["subgroup"], r


@pytest.mark.parametrize("target", ["attention", "experts"])
def test_peft_lora_inside_ddp_equals_unmodified(target: str, tmp_path: Path) -> None:
    for rank, r in enumerate(run_world(2, "tests.engine_cases:peft_parity", {"out_dir": str(tmp_path),
                                                                            "target": target})):
        assert r["grad_worst"] <= TOL, (rank, r["grad_worst_name"], r["grad_worst"])
        assert r["worst"] <= TOL, (rank, r["worst_name"], r["worst"])
        if target == "experts":
            assert r["rank_local_adapters"] == 8  # A and B of gate_up and down, 2 layers: this rank's experts
            # saved as plain PEFT saves the same adapters, read back both ways, a second adapter too
            assert r["state_dict_full"] and r["file_keys"] and r["file_shapes"] and r["same_config"], r
            assert r["two_adapters_keys"] and r["file_local_exact"] and r["ep_state_dict_exact"], r
            assert r["two_adapters_worst"] == 0.0, r  # loaded from one file by both: bit-equal
            # the wrapper's copies of the experts, named
            assert "ExpertParallelError" in r["modules_to_save_refused"] and any(
                f".experts.{w}." in r["modules_to_save_refused"] for w in ("original_module", "modules_to_save")), r
            assert r["frozen_counted"], r
            for key in ("state_dict_worst", "file_worst", "plain_reads_ep", "ep_reads_plain", "second_adapter",
                        "back_to_first", "low_cpu_mem_usage"):
                assert r[key] <= TOL, (key, r)
            if rank == 0:
                assert r["merged_worst"] <= 1e-6, r  # merged, gathered, loaded by plain transformers
        else:
            assert r["rank_local_adapters"] == 0


@pytest.mark.parametrize(("world", "backend"), [(1, "inductor"), (2, "aot_eager")], ids=["ep1-inductor", "ep2-aot_eager"])
def test_torch_compile_matches_eager(world: int, backend: str, tmp_path: Path) -> None:
    for r in run_world(world, "tests.engine_cases:compile_parity", {"out_dir": str(tmp_path), "backend": backend}):
        assert r["logits"] <= 1e-5 and r["grads"] <= 1e-5, r
        if world == 1:  # nothing to exchange, no host value: the whole model is one graph
            assert (r["graphs"], r["breaks"]) == (1, 0), r
            assert r["grouped_mm_per_graph"] == [2 * r["layers"]], r
            continue
        # graph breaks only at the exchange's host sync (the split sizes' .tolist(), at the start of
        # experts_and_combine) and the count all-to-all in dispatch
        assert set(r["break_sites"]) == {"dispatch.py:_launch", "comm.py:exchange_counts"}, r
        assert any(".tolist()" in line for line in r["break_lines"]), r
        # each layer's local experts (gate/up GEMM, activation, down GEMM) compile as one region
        assert r["grouped_mm_per_graph"] == [2] * r["layers"], r


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "m")


def _torchrun(script: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-12000:]
    return run


ENGINE_CASES = ["trainer_sgd", "trainer_sgd_clip", "trainer_adamw", "accelerate", "trainer_compile",
                "trainer_unprepared", "trainer_refusals", "trainer_lora_experts", "trainer_lora_attention_experts",
                "accelerate_lora_experts", "sft_lora_experts", "trainer_experts_only", "sft_gpt_oss_mxfp4_kept",
                "trainer_lora_fp8_kept", "trainer_bias_update", "accelerate_bias_update", "loop_global_aux",
                "trainer_global_aux", "sft_global_aux", "grpo", "grpo_lora", "grpo_resume", "grpo_vllm", "grpo_replay"]


@pytest.fixture(scope="module")
def engine_results(tiny_dir: Path, tmp_path_factory) -> dict:
    """Every Trainer / accelerate case in one torchrun (one start-up for all)."""
    out = tmp_path_factory.mktemp("engines")
    _torchrun(ROOT / "tests" / "engine_script.py", str(tiny_dir), str(out), *ENGINE_CASES)
    return {case: [json.loads((out / f"{case}-rank{r}.json").read_text()) for r in range(2)] for case in ENGINE_CASES}


@pytest.mark.parametrize("case", ["trainer_sgd", "trainer_sgd_clip", "trainer_adamw", "accelerate", "trainer_compile",
                                  "trainer_lora_experts", "trainer_lora_attention_experts", "accelerate_lora_experts",
                                  "sft_lora_experts", "trainer_experts_only", "trainer_lora_fp8_kept"])
def test_trainer_and_accelerate_equal_unmodified(case: str, engine_results: dict) -> None:
    for rank, r in enumerate(engine_results[case]):
        assert r["worst"] <= TOL, (rank, r["worst_name"], r["worst"])
        if "ref_norms" in r and r["ref_norms"]:  # the grad norm Trainer / accelerate report is the global one
            reported = r.get("grad_norm") or r.get("norms")
            assert reported == pytest.approx(r["ref_norms"], rel=1e-5), r


@pytest.mark.parametrize("case", ["trainer_adamw", "accelerate"])
def test_routing_statistics_logged_equal_a_hand_count(case: str, engine_results: dict) -> None:
    """EP 2 on 2 ranks: the moe/ logs of every step (Trainer with activation checkpointing and gradient
    accumulation 2: log_history; accelerate: a tracker and the project folder) equal a hand count of the
    unmodified model's routing of the same global batches."""
    for rank, r in enumerate(engine_results[case]):
        if case == "accelerate" and rank:
            continue  # accelerate's trackers log on the main process only
        assert_routing_logged(r, 3, rank)


@pytest.mark.parametrize("case", ["trainer_bias_update", "accelerate_bias_update"])
def test_selection_bias_updates_equal_a_hand_update(case: str, engine_results: dict) -> None:
    """routing.bias_update_rate on a tiny DeepSeek-V3 at EP 2 through Trainer and accelerate: the biases
    are bitwise a hand update of the unmodified model from each step's global count, alike on every
    rank, and the weights still follow the unmodified model; checkpoints keep them (resume, plain
    transformers' load, accelerate's load_state)."""
    for r in engine_results[case]:
        assert r["biases_equal"] and r["same_on_every_rank"] and r["worst"] <= TOL, r
        assert min(r["moved"]) > 0, r
        assert r.get("resumed_equal", True) and r.get("restored", True) and r.get("changed_after_save", True), r
    assert engine_results[case][0].get("reload_equal", True), engine_results[case][0]


@pytest.mark.parametrize("case", ["loop_global_aux", "trainer_global_aux", "sft_global_aux"])
def test_global_load_balancing_loss_equals_the_concatenated_batch(case: str, engine_results: dict) -> None:
    """routing.aux_loss: global at EP 2 in a DDP loop (padded rows), Trainer and TRL's SFTTrainer (its
    defaults: activation checkpointing, the loss on): the unmodified model stepped on the concatenated
    micro-batches of both ranks; in the loop every rank reports the global loss, not its own."""
    for r in engine_results[case]:
        assert r["worst"] <= TOL, (r["worst_name"], r["worst"])
        if case == "loop_global_aux":
            assert r["reported"] == pytest.approx(r["wanted"], rel=1e-6), r
            assert all(abs(a - b) > 1e-3 for a, b in zip(r["local"], r["wanted"], strict=True)), r
        if case == "sft_global_aux":  # also with runtime.balance forced on: rows moved, results unchanged
            assert r["checkpointing"] and r["aux_loss"], r
    if case == "sft_global_aux":
        assert sum(r["guests"] for r in engine_results[case]) > 0


def test_prepared_accelerator_saves_every_rank_s_experts(engine_results: dict) -> None:
    for r in engine_results["accelerate"]:
        assert r["state_worst"] == 0.0, r  # load_state put back the saved model after another step
    assert engine_results["accelerate"][0]["reload_saved"] == 0.0, engine_results["accelerate"][0]


def test_trainer_checkpoints_reload_and_resume(engine_results: dict) -> None:
    r0, r1 = engine_results["trainer_adamw"]
    # save_model and a checkpoint written during training load in plain transformers bit for bit
    assert r0["reload_final"] == 0.0 and r0["reload_checkpoint-3"] == 0.0, r0
    assert {"hp_rewrite_expert_optimizer-rank0-of-2.pt", "hp_rewrite_expert_optimizer-rank1-of-2.pt",
            "optimizer.pt", "model.safetensors"} <= set(r0["files"]), r0["files"]  # one file, as transformers writes
    # resuming from checkpoint-1 ends where the uninterrupted run ended, on every rank
    assert r0["resume_worst"] == 0.0 and r1["resume_worst"] == 0.0, (r0, r1)


@pytest.mark.parametrize("case", ["trainer_lora_experts", "trainer_lora_attention_experts", "trainer_lora_fp8_kept"])
def test_trainer_checkpoints_and_resumes_expert_adapters(case: str, engine_results: dict) -> None:
    """LoRA on the experts through Trainer: checkpoints hold the adapter as plain PEFT writes it (read
    back by plain PEFT bit for bit) and each rank's adapter optimizer state; resuming ends where the
    uninterrupted run ended. Experts only: no DDP (nothing for it to manage), the guard reduces.
    ``trainer_lora_fp8_kept``: a DeepSeek-V3 block-FP8 checkpoint under auto_patch with the experts kept
    as FP8 codes, LoRA on every Linear and the experts, against the dequantised unmodified model."""
    r0, r1 = engine_results[case]
    assert r0["reload_final"] == 0.0 and r0["reload_checkpoint-3"] == 0.0, r0
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "hp_rewrite_expert_optimizer-rank0-of-2.pt",
            "hp_rewrite_expert_optimizer-rank1-of-2.pt"} <= set(r0["files"]), r0["files"]
    assert r0["resume_worst"] == 0.0 and r1["resume_worst"] == 0.0, (r0, r1)
    want = "PeftModel" if case == "trainer_lora_experts" else "DistributedDataParallel"
    assert r0["wrapped"] == r1["wrapped"] == want, (r0, r1)


def test_sft_trainer_with_lora_on_the_experts_equals_unmodified(engine_results: dict) -> None:
    """SFTConfig's defaults (activation checkpointing, the load-balancing loss), LoRA on the experts
    only: the same losses, norms and adapters as SFTTrainer on the unmodified model with them."""
    for r in engine_results["sft_lora_experts"]:
        assert r["checkpointing"] and r["aux_loss"], r
        logged = r["routing"]["logs"]  # TRL's own log() keeps the routing statistics
        assert len(logged) == 2 and all(h["moe/imbalance"] >= 1.0 for h in logged), logged
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6), r
    assert engine_results["sft_lora_experts"][0]["reload_final"] == 0.0, engine_results["sft_lora_experts"][0]


def test_gpt_oss_recipe_on_kept_mxfp4_experts_equals_the_dequantised_model(engine_results: dict) -> None:
    """TRL's gpt-oss LoRA recipe under auto_patch, experts kept as MXFP4 at EP 2 (engine_script's
    sft_gpt_oss_mxfp4_kept): the same losses as the recipe on the unmodified dequantised model, the
    adapters within 1e-4 after two AdamW steps from PEFT's zero B (1e-5 is what the dequantised EP model
    reaches too: Adam's first steps divide rounding-level differences by the gradients' own size), the
    saved adapter read by plain PEFT bit for bit."""
    for r in engine_results["sft_gpt_oss_mxfp4_kept"]:
        assert r["kept"] == 4 and r["checkpointing"] and r["wrapped"] == "DistributedDataParallel", r
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6), r
        assert r["worst"] <= 1e-4, r
    assert engine_results["sft_gpt_oss_mxfp4_kept"][0]["reload_final"] == 0.0


def test_ddp_around_expert_adapters_only_is_refused_and_accelerate_leaves_it_out(engine_results: dict) -> None:
    for r in engine_results["accelerate_lora_experts"]:
        assert r["wrapped"] == "PeftModel" and "sync_gradients" in r["ddp_refused"], r
        # save_state / load_state: the adapter as PEFT saves it, each rank's optimizer, put back exactly
        assert r["state_worst"] == 0.0 and {"adapter_model.safetensors", "optimizer-rank0-of-2.pt",
                                             "optimizer-rank1-of-2.pt"} <= set(r["state_files"]), r
        assert "carries PEFT adapters" in r["save_model_refused"], r  # a full checkpoint would hold PEFT's names
    # accelerate's PEFT recipe (save_pretrained with get_state_dict): plain PEFT reads the adapter bit for bit
    assert engine_results["accelerate_lora_experts"][0]["recipe_worst"] == 0.0, engine_results["accelerate_lora_experts"][0]
    for r in engine_results["trainer_experts_only"]:  # the experts alone trained in full: no DDP either
        assert r["wrapped"] == "Qwen3MoeForCausalLM", r


def test_unprepared_trainer_save_is_refused(engine_results: dict) -> None:
    r0 = engine_results["trainer_unprepared"][0]
    assert "prepare_trainer" in r0["error"], r0


def test_prepare_trainer_refuses_what_it_cannot_make_exact(engine_results: dict) -> None:
    for r in engine_results["trainer_refusals"]:
        assert "not rewritten" in r["plain"], r
        assert r["peft_attention"] == "" and r["peft_attention_untouched"], r
        assert "DeepSpeed (ZeRO)" in r["deepspeed"] and "fsdp_version: 2" in r["deepspeed"], r


def test_grpo_through_trl_equals_unmodified(engine_results: dict) -> None:
    """TRL's GRPOTrainer (transformers generating, GRPOConfig's defaults: activation checkpointing,
    sampling; fp32) for one step, prepared, at EP 2 against the unmodified model under DDP, the same
    prompts and seed: the same logs (loss, rewards, completion lengths, entropy: the same completions
    sampled, in lockstep) and the same weights after the step (#46)."""
    for rank, r in enumerate(engine_results["grpo"]):
        assert r["checkpointing"] and "moe/imbalance" in r["moe_logged"], r  # the plan's routing statistics
        assert r["worst"] <= TOL and r["moved"] > 10 * TOL, (rank, r["worst_name"], r["worst"], r["moved"])
        mine, theirs = ([{k: v for k, v in h.items() if k != "step_time"} for h in logs]
                        for logs in (r["logs"], r["ref_logs"]))
        assert "completions/mean_length" in mine[0], mine
        assert_logs_agree(mine, theirs, context=rank)


def test_grpo_with_lora_equals_unmodified(engine_results: dict) -> None:
    """GRPO with LoRA on attention and experts (each rank's expert adapters its own), one step prepared at
    EP 2 against the unmodified model with the same adapters under DDP: the same logs and adapters (#46)."""
    for rank, r in enumerate(engine_results["grpo_lora"]):
        assert r["checkpointing"] and r["worst"] <= TOL and r["moved"] > 10 * TOL, (rank, r["worst"], r["moved"])
        assert "completions/mean_length" in r["logs"][0], r["logs"]
        assert_logs_agree(r["logs"], r["ref_logs"], context=rank)


def test_grpo_checkpoints_resume_where_the_run_was(engine_results: dict) -> None:
    """GRPO at EP 2, three steps with a checkpoint after each; a second trainer resumed from checkpoint-1
    ends bit for bit where the first did with the same logs (completions sampled alike: Trainer's RNG
    states), full fine-tuning and LoRA on attention and experts; each rank's expert optimizer state is
    in the checkpoint, and unmodified transformers loads checkpoint-3 as the model (#46)."""
    for rank, r in enumerate(engine_results["grpo_resume"]):
        for name, weights in (("full", "model.safetensors"), ("lora", "adapter_model.safetensors")):
            assert r[f"{name}_worst"] == 0.0, (rank, name, r[f"{name}_worst"])
            assert r[f"{name}_logs"] == r[f"{name}_first_logs"] and len(r[f"{name}_logs"]) >= 3, (rank, name, r)
            assert {weights, "hp_rewrite_expert_optimizer-rank0-of-2.pt", "hp_rewrite_expert_optimizer-rank1-of-2.pt",
                    "rng_state_0.pth", "rng_state_1.pth"} <= set(r[f"{name}_files"]), r[f"{name}_files"]
        if rank == 0:
            assert r["reload_checkpoint-3"] == 0.0, r["reload_checkpoint-3"]


def test_grpo_replays_the_rollout_routes(engine_results: dict) -> None:
    """Rollout routing replay (R3) through TRL's GRPOTrainer at EP 2 with vLLM colocated (a stand-in whose
    routers route differently from the policy's): two steps with GRPOConfig's defaults, and every token
    the engine forwarded goes, in every forward of the policy on it (old log-probabilities, training),
    to the experts the engine chose; the routers' disagreement with the engine is logged each step (#46).
    runtime.balance is forced on: the replayed choice's rows are balanced over the ranks, never re-routed (#61)."""
    for rank, r in enumerate(engine_results["grpo_replay"]):
        assert r["steps"] == 2 and r["checkpointing"] and r["forwards"] >= 4, (rank, r)
        assert r["compared"] > 100 and r["mismatched"] == 0 and r["missing"] == 0, (rank, r)
        assert r["lent_or_guests"] > 0, (rank, r)  # runtime.balance forced on: the replayed choice, balanced
        assert len(r["disagreement"]) == 2 and all(0 < d < 1 for d in r["disagreement"]), (rank, r)
        tp2 = r["tp2"]  # vllm_tensor_parallel_size=2: each rank picks its completions out of the group's outputs
        assert tp2["steps"] == 1 and tp2["compared"] > 50 and tp2["mismatched"] == tp2["missing"] == 0, (rank, tp2)
        assert "enable_return_routed_experts" in r["unflagged"] and "vllm_returns_routes" in r["unflagged"], r
        assert "vllm-serve neither records nor returns" in r["server"], r
        assert "does not generate with vLLM" in r["no_vllm"], r


def test_trl_vllm_weight_sync_sends_checkpoint_weights(engine_results: dict) -> None:
    """A prepared GRPOTrainer's vLLM weight sync (TRL's own VLLMGeneration, a recording engine): colocated
    and server mode send what plain transformers saves, under the names vLLM's Qwen3-MoE loader reads;
    with LoRA the merged weights (#46). Unprepared, where TRL would send each rank's slice under the full name,
    the first sync is refused on every rank, naming prepare_trainer: colocated, server, with LoRA (#56)."""
    for rank, r in enumerate(engine_results["grpo_vllm"]):
        assert not r["colocate"] and not r["server"] and not r["lora"], (rank, r)
        assert r["server_metadata"], r
        for unprepared in ("unprepared_colocate", "unprepared_server", "unprepared_colocate_lora"):
            assert "hp_rewrite.prepare_trainer(trainer)" in r[unprepared], (rank, unprepared, r[unprepared])
