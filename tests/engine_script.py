"""Engines as users run them, under torchrun (launched by tests/test_engines.py):

    torchrun --standalone --nproc-per-node 2 tests/engine_script.py MODEL_DIR OUT_DIR CASE [CASE ...]

Each case trains the expert-parallel model (``hp_rewrite.from_pretrained``) through an engine and,
on every rank, the unmodified transformers model (``from_pretrained`` of the same checkpoint)
stepped by hand on the whole batch of every step: the same samples, the mean loss over all their
tokens. Every rank writes ``OUT_DIR/<case>-rank<r>.json`` with the worst relative differences.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hp_rewrite  # noqa: E402
from hp_rewrite.runtime import installed  # noqa: E402
from hp_rewrite.sync.gradients import expert_parameters  # noqa: E402
from tests.engine_cases import lent_or_guests  # noqa: E402
from tests.training_cases import count_routing, z_loss_by_hand  # noqa: E402

PER_DEVICE, SEQ = 2, 8


def _samples(vocab: int, n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (n, SEQ), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _reference(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").train()


def _ep_model(model_dir: str, art: Path):
    return hp_rewrite.from_pretrained(model_dir, plan=ROOT / "plans" / "auto-ep2.yaml", artifact_dir=art,
                                      attn_implementation="eager")


def _reference_steps(ref, samples, steps: int, batch: int, optimizer, max_norm, routing: list | None = None,
                     bias_rate: float = 0.0):
    """Step the unmodified model on consecutive global batches of ``batch`` samples (mean loss over
    all their tokens, as Trainer computes it with ``average_tokens_across_devices``); ``routing``
    receives each step's hand count of the experts chosen, one list per layer in layer order; with
    ``bias_rate`` each layer's selection bias is updated by hand from that count after the step."""
    norms = []
    counts, handles = count_routing(ref) if routing is not None else ({}, [])
    for step in range(steps):
        chunk = samples[step * batch : (step + 1) * batch]
        ids = torch.stack([s["input_ids"] for s in chunk])
        counts.clear()
        ref(input_ids=ids, labels=ids).loss.backward()
        if routing is not None:
            routing.append([counts[layer].tolist() for layer in sorted(counts)])
        if max_norm:
            norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        for layer, chosen in counts.items() if bias_rate else ():
            bias = ref.get_submodule(f"model.layers.{layer}.mlp.gate").e_score_correction_bias
            load = chosen.float()
            with torch.no_grad():
                bias.add_(torch.sign(load.mean() - load), alpha=bias_rate)
    for h in handles:
        h.remove()
    return norms


def routing_logged(trainer_or_history, folder: Path | None, steps: int) -> dict:
    """What a run logged of its routing: the ``moe/`` values of each training log, and (rank 0) the
    first ``steps`` lines of the counts file written beside them."""
    history = getattr(getattr(trainer_or_history, "state", None), "log_history", trainer_or_history)
    logs = [{k: v for k, v in h.items() if k.startswith("moe/")} for h in history if "loss" in h]
    path = None if folder is None else folder / "hp_rewrite_routing.jsonl"
    lines = path.read_text().splitlines()[:steps] if path is not None and path.is_file() else []
    return {"logs": logs, "file": [json.loads(line) for line in lines]}


def _worst(model, ref) -> tuple[float, str]:
    """Worst relative difference of the parameters (each rank's experts against their rows)."""
    experts = {id(p) for p in expert_parameters(model)}
    ref_params = dict(ref.named_parameters())
    worst = (0.0, "")
    for name, p in model.named_parameters():
        target = ref_params[name].detach()
        if id(p) in experts:
            target = target[installed.binding(model.get_submodule(name.rsplit(".", 1)[0])).placement.local_index]
        err = ((p.detach() - target).abs().max() / target.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, (err, name))
    return worst


def _trainer(model, samples, out_dir, **overrides):
    from transformers import Trainer, TrainingArguments

    args = dict(output_dir=str(out_dir), per_device_train_batch_size=PER_DEVICE, use_cpu=True,
                ddp_backend="gloo", report_to=[], optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
                weight_decay=0.0, max_grad_norm=0.0, max_steps=1, save_strategy="no", logging_steps=1,
                train_sampling_strategy="sequential", dataloader_drop_last=True, seed=0,
                disable_tqdm=True)
    args.update(overrides)
    trainer = Trainer(model=model, args=TrainingArguments(**args), train_dataset=samples)
    return hp_rewrite.prepare_trainer(trainer)


def case_trainer_sgd(model_dir, out, max_norm=0.0):
    """One SGD step (lr 1) through Trainer equals the unmodified model's full-batch step."""
    world = dist.get_world_size()
    ref, model = _reference(model_dir), _ep_model(model_dir, out / "art")
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world)
    trainer = _trainer(model, samples, out / "sgd", max_grad_norm=max_norm)
    result = trainer.train()
    norms = _reference_steps(ref, samples, 1, PER_DEVICE * world, torch.optim.SGD(ref.parameters(), lr=1.0), max_norm)
    worst, name = _worst(model, ref)
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return {"worst": worst, "worst_name": name, "loss": result.training_loss, "grad_norm": logged,
            "ref_norms": norms}


def case_trainer_sgd_clip(model_dir, out):
    return case_trainer_sgd(model_dir, out, max_norm=0.5)


def case_trainer_experts_only(model_dir, out):
    """Only the expert weights trained (the rest frozen): DDP would manage nothing, so prepare_trainer
    leaves it out and the engine guard reduces; one SGD step at lr 1 with clipping."""
    world = dist.get_world_size()
    ref, model = _reference(model_dir), _ep_model(model_dir, out / "art")
    for m in (ref, model):
        for name, p in m.named_parameters():
            p.requires_grad_(".experts." in name)
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world)
    trainer = _trainer(model, samples, out / "experts_only", max_grad_norm=0.5)
    trainer.train()
    norms = _reference_steps(ref, samples, 1, PER_DEVICE * world,
                             torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=1.0), 0.5)
    worst, name = _worst(model, ref)
    return {"worst": worst, "worst_name": name, "ref_norms": norms, "wrapped": type(trainer.model_wrapped).__name__,
            "grad_norm": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}


def _adamw(params):
    # no weight decay: Trainer leaves norms and biases out of it, a hand-built AdamW would not
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, weight_decay=0.0)


def case_trainer_adamw(model_dir, out):
    """Three AdamW steps with gradient_accumulation_steps=2 and clipping, a checkpoint after each;
    then save_model; then a second Trainer resumes from checkpoint-1 and ends where the first did."""
    from transformers import AutoModelForCausalLM

    world, steps, accum = dist.get_world_size(), 3, 2
    ref, model = _reference(model_dir), _ep_model(model_dir, out / "art")
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    common = dict(optim="adamw_torch", learning_rate=1e-3, adam_epsilon=1e-4, weight_decay=0.0, max_steps=steps,
                  gradient_accumulation_steps=accum, max_grad_norm=0.5, save_strategy="steps", save_steps=1,
                  gradient_checkpointing=True)  # a recomputed forward must not count its tokens again
    trainer = _trainer(model, samples, out / "adamw", **common)
    trainer.train()
    hand = []
    _reference_steps(ref, samples, steps, PER_DEVICE * world * accum, _adamw(ref.parameters()), 0.5, hand)
    worst, name = _worst(model, ref)
    trainer.save_model(str(out / "adamw" / "final"))
    result = {"worst": worst, "worst_name": name, "hand_routing": hand,
              "routing": routing_logged(trainer, out / "adamw", steps)}
    if dist.get_rank() == 0:  # unmodified transformers loads every saved model bit for bit
        for folder in ("final", "checkpoint-3"):
            plain = AutoModelForCausalLM.from_pretrained(out / "adamw" / folder, attn_implementation="eager")
            result[f"reload_{folder}"] = _worst(model, plain)[0]
        result["files"] = sorted(os.listdir(out / "adamw" / "checkpoint-1"))
    dist.barrier()
    resumed_model = _ep_model(model_dir, out / "art")
    resumed = _trainer(resumed_model, samples, out / "adamw", **common)
    resumed.train(resume_from_checkpoint=str(out / "adamw" / "checkpoint-1"))
    diffs = [((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12)).item()
             for a, b in zip(resumed_model.parameters(), model.parameters(), strict=True)]
    result["resume_worst"] = max(diffs)
    return result


def _lora_state(model) -> dict:
    """The LoRA tensors of a PEFT model's state dict (an expert-parallel one: gathered, collective)."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if "lora_" in k}


def _lora_worst(model, ref) -> float:
    got, want = _lora_state(model), _lora_state(ref)
    assert sorted(got) == sorted(want) and got, (sorted(got), sorted(want))
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)).item() for k in want)


def _plain_peft_reads(model, model_dir, folders: dict, load_ref=None) -> dict:
    """``reload_<name>``: the largest difference between ``model``'s adapters and what plain transformers +
    PEFT read from each saved folder (rank 0; every rank joins the gathering state dict)."""
    from peft import PeftModel

    want = _lora_state(model)
    if dist.get_rank() != 0:
        return {}
    found = {}
    for name, folder in folders.items():
        got = _lora_state(PeftModel.from_pretrained((load_ref or _reference)(model_dir), folder))
        found[f"reload_{name}"] = max((got[k] - want[k]).abs().max().item() for k in want)
    return found


def _lora_pair(model, ref, config: dict):
    """``model`` (expert-parallel) and ``ref`` (unmodified) with the same LoRA adapters of ``config``: each
    rank's expert adapters its own draw (:func:`_own_expert_adapters`), the reference given all of them."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = get_peft_model(model, LoraConfig(**config))
    _own_expert_adapters(model)
    ref = get_peft_model(ref, LoraConfig(**config))
    ref.load_state_dict(_lora_state(model), strict=False)
    return model, ref


def _own_expert_adapters(model) -> None:
    """Draw each rank's expert adapters from a generator of its own: every expert's differ, so an
    expert gathered into the wrong place shows (the expert replicas of an EP rank alike)."""
    from hp_rewrite.loading.record import rewritten_model

    gen = torch.Generator().manual_seed(100 + rewritten_model(model).hp_rewrite.ep.rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def case_trainer_lora_experts(model_dir, out, attention: bool = False, kept_fp8: bool = False):
    """LoRA on the experts only (PEFT target_parameters: no parameter for DDP to manage), three AdamW
    steps with gradient accumulation 2 and clipping, a checkpoint after each; save_model; a second
    Trainer resumes from checkpoint-1 and ends where the first did; plain PEFT reads what was saved.
    ``attention``: LoRA on attention too (Trainer builds DDP around the model). ``kept_fp8``: a DeepSeek-V3
    block-FP8 checkpoint loaded under auto_patch with ``FineGrainedFP8Config(dequantize=False)`` (experts
    kept as codes), LoRA on every Linear and the experts, against the unmodified model loaded with
    ``dequantize=True``."""
    from peft import LoraConfig, PeftModel, get_peft_model

    world, steps, accum = dist.get_world_size(), 3, 2
    config = dict(r=2, lora_alpha=4, init_lora_weights=False,
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    load_ep, load_ref = _ep_model, _reference
    if attention:
        config["target_modules"] = ["q_proj", "v_proj"]
    out = out / ("lora_attention" if attention else "lora_experts")
    if kept_fp8:
        config["target_modules"] = "all-linear"
        out = out.parent / "lora_fp8_kept"
        model_dir, load_ep, load_ref = _fp8_checkpoint(out.parent), _kept_fp8_model, _dequantised_fp8
    ref = get_peft_model(load_ref(model_dir), LoraConfig(**config))
    torch.manual_seed(5)  # replicated adapters (attention) alike on every rank, as DDP makes them
    model = get_peft_model(load_ep(model_dir, out.parent / "art"), LoraConfig(**config))
    _own_expert_adapters(model)
    ref.load_state_dict(_lora_state(model), strict=False)  # the same adapters, full shape
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    common = dict(optim="adamw_torch", learning_rate=1e-3, adam_epsilon=1e-4, weight_decay=0.0, max_steps=steps,
                  gradient_accumulation_steps=accum, max_grad_norm=0.5, save_strategy="steps", save_steps=1)
    trainer = _trainer(model, samples, out, **common)
    trainer.train()
    ref_norms = _reference_steps(ref, samples, steps, PER_DEVICE * world * accum,
                                 _adamw([p for p in ref.parameters() if p.requires_grad]), 0.5)
    result = {"worst": _lora_worst(model, ref), "worst_name": "lora",
              "grad_norm": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
              "ref_norms": ref_norms, "wrapped": type(trainer.model_wrapped).__name__}
    trainer.save_model(str(out / "final"))
    want = _lora_state(model)
    if dist.get_rank() == 0:  # plain transformers + PEFT read the adapter the run wrote
        for folder in ("final", "checkpoint-3"):
            got = _lora_state(PeftModel.from_pretrained(load_ref(model_dir), out / folder))
            result[f"reload_{folder}"] = max((got[k] - want[k]).abs().max().item() for k in want)
        result["files"] = sorted(os.listdir(out / "checkpoint-1"))
    dist.barrier()
    torch.manual_seed(99)
    resumed_model = get_peft_model(load_ep(model_dir, out.parent / "art"), LoraConfig(**config))
    resumed = _trainer(resumed_model, samples, out, **common)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    result["resume_worst"] = _lora_worst(resumed_model, model)
    return result


def case_trainer_lora_attention_experts(model_dir, out):
    return case_trainer_lora_experts(model_dir, out, attention=True)


def _fp8_checkpoint(out: Path) -> Path:
    """A tiny DeepSeek-V3 in the Hub's block-FP8 layout (rank 0 writes it once)."""
    from tests.quantized_cases import make_checkpoint

    checkpoint = out / "deepseek_v3-fp8"
    if dist.get_rank() == 0 and not checkpoint.is_dir():
        make_checkpoint("deepseek_v3-fp8", checkpoint)
    dist.barrier()
    return checkpoint


def _kept_fp8_model(model_dir, art: Path, plan: Path = ROOT / "plans" / "auto-ep2.yaml"):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    with hp_rewrite.auto_patch(plan, artifact_dir=art):
        return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32,
                                                    quantization_config=FineGrainedFP8Config(dequantize=False))


def _dequantised_fp8(model_dir):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32,
                                                quantization_config=FineGrainedFP8Config(dequantize=True)).train()


def case_trainer_lora_fp8_kept(model_dir, out):
    return case_trainer_lora_experts(model_dir, out, kept_fp8=True)


def case_accelerate_lora_experts(model_dir, out):
    """LoRA on the experts only through accelerate: prepare leaves DDP out (nothing for it to manage),
    accumulate(2) and clip_grad_norm_ in the user's loop, two SGD steps with momentum; save_state, one
    more step, load_state puts back the adapters and the optimizer's momentum bit for bit; a DDP the
    user builds around such a model is refused clearly."""
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel

    from hp_rewrite.runtime.errors import ExpertParallelError

    world, steps, accum = dist.get_world_size(), 2, 2
    config = dict(r=2, lora_alpha=4, init_lora_weights=False, target_parameters=["mlp.experts.gate_up_proj"])
    ref = get_peft_model(_reference(model_dir), LoraConfig(**config))
    model = get_peft_model(_ep_model(model_dir, out / "art"), LoraConfig(**config))
    _own_expert_adapters(model)
    ref.load_state_dict(_lora_state(model), strict=False)
    try:
        DistributedDataParallel(model)
        refused = ""
    except ExpertParallelError as e:
        refused = str(e)
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    accelerator = hp_rewrite.prepare_accelerator(Accelerator(cpu=True, gradient_accumulation_steps=accum))
    ids = torch.stack([s["input_ids"] for s in samples]).view(steps * accum, world, PER_DEVICE, SEQ)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0, momentum=0.5)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    norms = []

    def step(batch):
        with accelerator.accumulate(prepared):
            accelerator.backward(prepared(input_ids=batch, labels=batch).loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(prepared.parameters(), 0.5).item())
            optimizer.step()
            optimizer.zero_grad()

    for batch in ids[:, dist.get_rank()]:
        step(batch)
    ref_norms = _reference_steps(ref, samples, steps, PER_DEVICE * world * accum, torch.optim.SGD(
        [p for p in ref.parameters() if p.requires_grad], lr=1.0, momentum=0.5), 0.5)
    result = {"worst": _lora_worst(model, ref), "worst_name": "lora", "norms": list(norms), "ref_norms": ref_norms,
              "wrapped": type(prepared).__name__, "ddp_refused": refused}
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    momentum = {n: optimizer.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()
                if p.requires_grad}
    accelerator.save_state(str(out / "acc_lora_state"))
    for batch in ids[:accum, dist.get_rank()]:  # one more step moves everything
        step(batch)
    accelerator.load_state(str(out / "acc_lora_state"))
    params = dict(model.named_parameters())
    result["state_worst"] = max(max((params[n] - v).abs().max().item() for n, v in saved.items()),
                                max((optimizer.state[params[n]]["momentum_buffer"] - v).abs().max().item()
                                    for n, v in momentum.items()))
    result["state_files"] = sorted(os.listdir(out / "acc_lora_state" / "hp_rewrite_adapter_0"))
    # accelerate's PEFT saving recipe: save_pretrained with accelerator.get_state_dict (every rank calls it)
    from peft import PeftModel

    unwrapped = accelerator.unwrap_model(prepared)
    unwrapped.save_pretrained(out / "acc_recipe", is_main_process=accelerator.is_main_process,
                              state_dict=accelerator.get_state_dict(prepared))
    want = _lora_state(model)
    if dist.get_rank() == 0:
        got = _lora_state(PeftModel.from_pretrained(_reference(model_dir), out / "acc_recipe"))
        result["recipe_worst"] = max((got[k] - want[k]).abs().max().item() for k in want) if sorted(got) == sorted(
            want) else float("inf")
    try:
        accelerator.save_model(prepared, str(out / "acc_full"))
        result["save_model_refused"] = ""
    except ExpertParallelError as e:
        result["save_model_refused"] = str(e)
    return result


def _sft_both(model, ref, out: Path, **overrides):
    """TRL's SFTTrainer for two steps (accumulation 2, fp32) on the expert-parallel model (prepared) and on
    the unmodified one, the same samples; returns both trainers."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tests.fsdp_engine_script import _tokenizer

    samples = _samples(model.config.vocab_size, PER_DEVICE * dist.get_world_size() * 2 * 2)
    data = Dataset.from_dict({"input_ids": [s["input_ids"].tolist() for s in samples]})
    trainers = []
    for name, m in (("ep", model), ("ref", ref)):
        args = dict(output_dir=str(out / name), per_device_train_batch_size=PER_DEVICE, use_cpu=True, report_to=[],
                    bf16=False, logging_steps=1, save_strategy="no", max_steps=2, gradient_accumulation_steps=2,
                    adam_epsilon=1e-4, train_sampling_strategy="sequential", seed=0, dataloader_drop_last=True,
                    disable_tqdm=True)
        trainer = SFTTrainer(model=m, args=SFTConfig(**args | overrides), train_dataset=data,
                             processing_class=_tokenizer(m.config.vocab_size))
        if name == "ep":
            hp_rewrite.prepare_trainer(trainer)
        trainer.train()
        trainers.append(trainer)
    return trainers


def _word_tokenizer(vocab: int):
    """Words ``t0``..``t{vocab-1}`` split on spaces (GRPO's prompts are text), ``t2`` the EOS."""
    from hp_rewrite.tiny import tiny_tokenizer

    return tiny_tokenizer(vocab)


def _refusal(trainer) -> str:
    """What ``prepare_trainer`` refuses ``trainer`` with ("" when it accepts it)."""
    from hp_rewrite.runtime.errors import ExpertParallelError

    try:
        hp_rewrite.prepare_trainer(trainer)
    except ExpertParallelError as e:
        return str(e)
    return ""


def _grpo_trainer(model_dir, out_dir: Path, model, trainer_class=None, prepare: bool = True, **overrides):
    """TRL's GRPOTrainer as the GRPO cases run it (generation by transformers, GRPOConfig's defaults:
    activation checkpointing, sampling at temperature 1; fp32 here for exact comparisons): 8 prompts of
    4 words, 2 generations each, a reward that varies within a group (so the advantages do not vanish);
    prepared unless ``prepare`` is False. ``trainer_class`` (GRPOTrainer -> a subclass) and ``overrides``
    (GRPOConfig's) as the case needs."""
    from datasets import Dataset
    from transformers import AutoConfig
    from trl import GRPOConfig, GRPOTrainer

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    gen = torch.Generator().manual_seed(21)
    prompts = [" ".join(f"t{i}" for i in torch.randint(3, vocab, (4,), generator=gen).tolist()) for _ in range(8)]

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = dict(output_dir=str(out_dir), per_device_train_batch_size=2, num_generations=2, max_completion_length=6,
                max_steps=1, learning_rate=1e-3, adam_epsilon=1e-4, bf16=False, use_cpu=True, report_to=[],
                logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True)
    trainer = (trainer_class or (lambda c: c))(GRPOTrainer)(
        model=model, reward_funcs=reward, args=GRPOConfig(**args | overrides),
        train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=_word_tokenizer(vocab))
    return hp_rewrite.prepare_trainer(trainer) if prepare else trainer


def _grpo_logs(trainer) -> list[dict]:
    """A GRPO run's logs without timings, steps and ``moe/`` keys (what the unmodified model's also log)."""
    return [{k: v for k, v in h.items() if not k.startswith("moe/") and "runtime" not in k and "per_second" not in k
             and k not in ("epoch", "step", "total_flos", "train_loss", "step_time")} for h in trainer.state.log_history]


def _grpo_both(model_dir, out: Path, models: dict, trainer_class=None, **overrides):
    """One GRPOTrainer step (:func:`_grpo_trainer`) for the unmodified model (``"ref"``) and the
    expert-parallel one (``"ep"``, prepared), the same prompts and seed; both trainers and their logs."""
    trainers = {}
    for name in ("ref", "ep"):
        trainer = _grpo_trainer(model_dir, out / name, models[name], trainer_class, prepare=name == "ep", **overrides)
        trainer.train()
        trainers[name] = trainer
    return trainers, {name: _grpo_logs(t) for name, t in trainers.items()}


def case_grpo(model_dir, out):
    """TRL's GRPOTrainer for one step on the expert-parallel model (prepared) and on the unmodified one
    under DDP (:func:`_grpo_both`): generation in lockstep (#46) samples the same completions, so the logs
    and the weights after the step are the same."""
    trainers, logs = _grpo_both(model_dir, out / "grpo", {"ref": _reference(model_dir),
                                                           "ep": _ep_model(model_dir, out / "art")})
    ref, ep = trainers["ref"], trainers["ep"]
    worst, worst_name = _worst(ep.model, ref.model)
    return {"worst": worst, "worst_name": worst_name, "logs": logs["ep"], "ref_logs": logs["ref"],
            "checkpointing": ep.args.gradient_checkpointing,
            "moe_logged": sorted(k for h in ep.state.log_history for k in h if k.startswith("moe/")),
            "moved": max((p.detach() - q).abs().max().item() for p, q in
                         zip(ref.model.parameters(), _reference(model_dir).parameters(), strict=True))}


def case_grpo_lora(model_dir, out):
    """GRPO with LoRA on attention and on the experts (PEFT's target_parameters), each rank's expert
    adapters its own draw, against the unmodified model with the same adapters under DDP: one step gives
    the same logs and the same adapters after it (the base untouched)."""

    config = dict(r=2, lora_alpha=4, target_modules=["q_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model, ref = _lora_pair(_ep_model(model_dir, out / "art"), _reference(model_dir), config)
    before = _lora_state(ref)
    trainers, logs = _grpo_both(model_dir, out / "grpo_lora", {"ref": ref, "ep": model})
    after = _lora_state(ref)
    return {"worst": _lora_worst(model, ref), "logs": logs["ep"], "ref_logs": logs["ref"],
            "checkpointing": trainers["ep"].args.gradient_checkpointing,
            "moved": max((after[k] - before[k]).abs().max().item() for k in before)}


def case_grpo_resume(model_dir, out):
    """GRPO for three steps with a checkpoint after each, then a second trainer resuming from
    checkpoint-1 (Trainer's RNG states restored: the same completions sampled) ends where the first did:
    the same weights and the same logs of steps 2 and 3; unmodified transformers loads checkpoint-3 as the
    model, bit for bit. Also with LoRA on attention and experts (the adapters and their optimizer state)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    common = dict(max_steps=3, save_strategy="steps", save_steps=1)
    lora = dict(r=2, lora_alpha=4, target_modules=["q_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    result = {}
    for name in ("full", "lora"):
        folder = out / "grpo_resume" / name
        runs = []
        for resume in (None, str(folder / "checkpoint-1")):
            model = _ep_model(model_dir, out / "art")
            if name == "lora":
                torch.manual_seed(3)
                model = get_peft_model(model, LoraConfig(**lora))
                _own_expert_adapters(model)
            trainer = _grpo_trainer(model_dir, folder, model, **common)
            trainer.train(resume_from_checkpoint=resume)
            runs.append((model, _grpo_logs(trainer)))
        (first, first_logs), (resumed, resumed_logs) = runs
        got, want = (dict(m.state_dict()) for m in (resumed, first))  # gathered: every expert (collective)
        result[f"{name}_worst"] = max((got[k] - want[k]).abs().max().item() for k in want)
        result[f"{name}_logs"], result[f"{name}_first_logs"] = resumed_logs, first_logs
        result[f"{name}_files"] = sorted(os.listdir(folder / "checkpoint-1"))
        if name == "full" and dist.get_rank() == 0:
            plain = AutoModelForCausalLM.from_pretrained(folder / "checkpoint-3", attn_implementation="eager")
            result["reload_checkpoint-3"] = _worst(first, plain)[0]
        dist.barrier()
    return result


def case_grpo_vllm(model_dir, out):
    """TRL's vLLM paths on a prepared GRPOTrainer, through TRL's real ``VLLMGeneration`` with a recording
    stand-in for vLLM's engine (tests/vllm_standin.py): colocated, every rank's engine gets exactly
    ``checkpoint_weights`` (the names vLLM's Qwen3-MoE loader reads, full tensors, what plain
    transformers saves), also with LoRA (the merged weights under the base names); server mode, the
    main process pushes the same and its metadata; unprepared (where TRL would send each rank's slice of
    the experts under the full tensors' names), the first sync is refused."""
    import torch.distributed as dist
    from datasets import Dataset
    from peft import LoraConfig
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from trl import GRPOConfig, GRPOTrainer

    from hp_rewrite.runtime.errors import ExpertParallelError
    from tests.vllm_standin import vllm_name_problems, vllm_standin

    rank = dist.get_rank()
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    data = Dataset.from_dict({"prompt": ["t3 t4 t5", "t6 t7 t8"] * 4})
    plain_dir = out / "grpo_vllm" / "plain"
    if rank == 0:
        _reference(model_dir).save_pretrained(plain_dir)
    dist.barrier()
    want = load_file(plain_dir / "model.safetensors")

    def synced(mode: str, prepare: bool = True, peft=None):
        args = GRPOConfig(output_dir=str(out / "grpo_vllm" / mode), per_device_train_batch_size=2, num_generations=2,
                          max_completion_length=4, max_steps=1, use_vllm=True, vllm_mode=mode, bf16=False,
                          use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
        with vllm_standin():
            trainer = GRPOTrainer(model=_ep_model(model_dir, out / "art"), reward_funcs=lambda completions, **k:
                                  [0.0] * len(completions), args=args, train_dataset=data,
                                  processing_class=_word_tokenizer(vocab), peft_config=peft)
            if prepare:
                hp_rewrite.prepare_trainer(trainer)
            trainer.vllm_generation.sync_weights()  # what each step does before generating
        generation = trainer.vllm_generation
        sent = generation.llm.loaded if mode == "colocate" else getattr(generation, "vllm_client", None)
        return trainer, sent

    def problems(sent, expected, where):
        from tests.weights_cases import compare

        return compare(sent, expected, where) + vllm_name_problems("qwen3_moe", sent, 8)

    r = {}
    _, sent = synced("colocate")
    r["colocate"] = problems(sent, want, "colocate")
    trainer, client = synced("server")
    if rank == 0:
        r["server"] = problems(client.received, want, "server")
        r["server_metadata"] = client.metadata == [(n, str(t.dtype).removeprefix("torch."), list(t.shape))
                                                   for n, t in client.received]
    else:
        r["server"], r["server_metadata"] = ([] if client is None else ["a client off the main process"]), True
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj"])
    trainer, sent = synced("colocate", peft=lora)
    streamed = list(hp_rewrite.checkpoint_weights(trainer.model))
    r["lora"] = problems(sent, dict(streamed), "lora") + (
        [] if not any(torch.equal(t, want[n]) for n, t in streamed if "q_proj" in n) else ["adapter not merged"])
    for mode, peft in (("colocate", None), ("server", None), ("colocate", lora)):  # unprepared: refused at the sync
        try:
            synced(mode, prepare=False, peft=peft)
            r[f"unprepared_{mode}{'_lora' if peft else ''}"] = ""
        except ExpertParallelError as e:
            r[f"unprepared_{mode}{'_lora' if peft else ''}"] = str(e)
    return r


def case_grpo_replay(model_dir, out):
    """Rollout routing replay through TRL's GRPOTrainer at EP 2, vLLM colocated (the stand-in generating with
    a plain transformers model whose routers are perturbed after each sync, as an inference engine's kernels
    make it route differently), built inside ``vllm_returns_routes()`` and prepared with the plan's
    ``routing.replay_rollout``, two steps with GRPOConfig's defaults (activation checkpointing, the
    importance-sampling correction's old log-probabilities): every forward of the policy on the samples
    sends each token the engine forwarded to the experts the engine chose, through TRL's own shuffling and
    chunking; the disagreement is logged. Refusals: server mode, an engine built without routes, no vLLM."""
    from datasets import Dataset
    from transformers import AutoConfig
    from trl import GRPOConfig, GRPOTrainer

    from hp_rewrite.training.rollout import moe_layer_indices
    from tests.vllm_standin import RecordingLLM, vllm_standin

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    plan = out / "replay-plan.yaml"
    # runtime.balance forced on (any imbalance, any piece moves): the replayed choice is balanced as it is
    plan.write_text("version: 1\nep_size: 2\narchetype: auto\nrouting:\n  replay_rollout: true\n"
                    "runtime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1}\n")
    gen = torch.Generator().manual_seed(dist.get_rank())
    data = Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in torch.randint(3, vocab, (int(n),), generator=gen).tolist())
                                         for n in torch.randint(2, 6, (8,), generator=gen)]})

    def trainer_for(name: str, **overrides):
        model = hp_rewrite.from_pretrained(model_dir, plan=plan, artifact_dir=out / "art-replay",
                                           attn_implementation="eager")
        args = dict(output_dir=str(out / "grpo_replay" / name), per_device_train_batch_size=2, num_generations=2,
                    max_completion_length=5, max_steps=2, learning_rate=1e-2, use_vllm=True, vllm_mode="colocate",
                    bf16=False, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True)
        return GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
                           args=GRPOConfig(**args | overrides), train_dataset=data,
                           processing_class=_word_tokenizer(vocab))

    def replayed_run(name: str, **overrides) -> dict:
        """Train under record_routing; compare every forward's experts with what the engine returned."""
        with hp_rewrite.vllm_returns_routes():
            trainer = trainer_for(name, **overrides)
        hp_rewrite.prepare_trainer(trainer)
        from hp_rewrite.loading.record import rewritten_model

        model = rewritten_model(trainer.model)
        seen = []
        model.register_forward_pre_hook(lambda m, a, kw: seen.append((kw["input_ids"].clone(),
                                                                      kw["attention_mask"].clone())), with_kwargs=True)
        with hp_rewrite.record_routing(model) as used:
            trainer.train()
        engine = {tuple(p + c): routes for p, c, routes in trainer.vllm_generation.llm.returned}
        compared = mismatched = missing = 0
        for layer, column in moe_layer_indices(model).items():
            assert len(used.layers[layer]) == len(seen), (len(used.layers[layer]), len(seen))
            for (ids, mask), chosen in zip(seen, used.layers[layer], strict=True):
                chosen = chosen.reshape(*ids.shape, -1).long()
                for row in range(ids.shape[0]):
                    real = mask[row].nonzero().flatten()
                    routes = engine.get(tuple(ids[row, real].tolist()))
                    if routes is None:
                        missing += 1
                        continue
                    want, got = routes[:, column].long(), chosen[row, real[:-1]]
                    compared += want.numel()
                    mismatched += int((got.sort(-1).values != want.sort(-1).values).sum())
        return dict(compared=compared, mismatched=mismatched, missing=missing, forwards=len(seen),
                    disagreement=[h["moe/replay_disagreement"] for h in trainer.state.log_history
                                  if "moe/replay_disagreement" in h],
                    checkpointing=trainer.args.gradient_checkpointing, steps=trainer.state.global_step,
                    lent_or_guests=lent_or_guests(model))

    r = {}
    RecordingLLM.router_noise = 0.3
    try:
        with vllm_standin():
            r["unflagged"] = _refusal(trainer_for("unflagged"))
            r["server"] = _refusal(trainer_for("server", vllm_mode="server"))
            r.update(replayed_run("replay"))
            # one vLLM over both ranks: TRL gathers the prompts, every rank gets every output, keeps its own
            r["tp2"] = replayed_run("replay_tp2", vllm_tensor_parallel_size=2, max_steps=1)
    finally:
        RecordingLLM.router_noise = 0.0
    r["no_vllm"] = _refusal(trainer_for("no_vllm", use_vllm=False))
    return r


def case_sft_lora_experts(model_dir, out):
    """TRL's SFTTrainer with SFTConfig's defaults (activation checkpointing, the load-balancing loss;
    fp32 here for an exact comparison) and LoRA on the experts only, on the expert-parallel model and
    on the unmodified model with the same adapters in the same world (the load-balancing loss is per
    rank's micro-batch in both); save_model writes the adapter plain PEFT reads."""


    config = dict(r=2, lora_alpha=4, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model, ref = _lora_pair(_ep_model(model_dir, out / "art"), _reference(model_dir), config)
    ep, reference = _sft_both(model, ref, out / "sft", max_grad_norm=0.5, learning_rate=1e-3)
    result = {"worst": _lora_worst(model, ref), "worst_name": "lora", "checkpointing": ep.args.gradient_checkpointing,
              "aux_loss": ep.aux_loss_enabled, "routing": routing_logged(ep, None, 2), "losses": [h["loss"] for h in ep.state.log_history if "loss" in h],
              "ref_losses": [h["loss"] for h in reference.state.log_history if "loss" in h],
              "grad_norm": [h["grad_norm"] for h in ep.state.log_history if "grad_norm" in h],
              "ref_norms": [h["grad_norm"] for h in reference.state.log_history if "grad_norm" in h]}
    ep.save_model(str(out / "sft" / "final"))
    result.update(_plain_peft_reads(model, model_dir, {"final": out / "sft" / "final"}))
    return result


def case_sft_gpt_oss_mxfp4_kept(model_dir, out):
    """The published gpt-oss LoRA recipe (TRL's SFTTrainer, Mxfp4Config, LoRA on every Linear and on
    chosen layers' experts through target_parameters, SFTConfig's activation checkpointing, a cosine
    schedule) unchanged under auto_patch, with the experts kept as MXFP4 (``dequantize=False``), at EP 2,
    against the same recipe on the unmodified model loaded with ``dequantize=True`` and the same
    adapters (fp32; Adam's epsilon raised from 1e-8 to damp what its first steps do to rounding-level
    gradient differences of PEFT's zero-initialised B: still ~1e-5 after two steps, kept or dequantised
    alike); save_model writes the adapter plain PEFT reads."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from hp_rewrite.runtime.compute.quantized import QuantizedWeight
    from tests.quantized_cases import make_checkpoint

    checkpoint = out / "gpt_oss-mxfp4"
    if dist.get_rank() == 0 and not checkpoint.is_dir():
        make_checkpoint("gpt_oss-mxfp4", checkpoint)
    dist.barrier()
    kwargs = dict(attn_implementation="eager", dtype=torch.float32, use_cache=False, device_map="auto")
    with hp_rewrite.auto_patch(ROOT / "plans" / "auto-ep2.yaml", artifact_dir=out / "art"):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=Mxfp4Config(dequantize=False),
                                                     **kwargs)
    kept = sum(isinstance(p, QuantizedWeight) for p in model.parameters())
    layers = range(model.config.num_hidden_layers)
    config = dict(r=8, lora_alpha=16, target_modules="all-linear",
                  target_parameters=[f"{i}.mlp.experts.{w}" for i in layers for w in ("gate_up_proj", "down_proj")])
    torch.manual_seed(3)  # the replicated adapters alike on every rank
    model = get_peft_model(model, LoraConfig(**config))
    _own_expert_adapters(model)
    ref = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=Mxfp4Config(dequantize=True), **kwargs)
    ref = get_peft_model(ref, LoraConfig(**config))
    ref.load_state_dict(_lora_state(model), strict=False)
    ep, reference = _sft_both(model, ref, out / "sft_oss", learning_rate=2e-4, warmup_steps=0.03,
                              lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1})
    result = {"worst": _lora_worst(model, ref), "worst_name": "lora", "kept": kept,
              "checkpointing": ep.args.gradient_checkpointing, "wrapped": type(ep.model_wrapped).__name__,
              "losses": [h["loss"] for h in ep.state.log_history if "loss" in h],
              "ref_losses": [h["loss"] for h in reference.state.log_history if "loss" in h]}
    ep.save_model(str(out / "sft_oss" / "final"))
    want = _lora_state(model)
    if dist.get_rank() == 0:
        plain = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=Mxfp4Config(dequantize=True),
                                                     **kwargs)
        got = _lora_state(PeftModel.from_pretrained(plain, out / "sft_oss" / "final"))
        result["reload_final"] = max((got[k] - want[k]).abs().max().item() for k in want)
    return result


def _recording_tracker():
    """An accelerate tracker that keeps what it is given (what TensorBoard or W&B would receive)."""
    from accelerate.tracking import GeneralTracker

    class Recorded(GeneralTracker):
        name, requires_logging_directory = "recorded", False

        def __init__(self):
            super().__init__()
            self.logged = []

        @property
        def tracker(self):
            return self.logged

        def log(self, values, step=None, **kwargs):
            self.logged.append({"step": step, **values})

    return Recorded()


def case_accelerate(model_dir, out):
    """Accelerator.prepare + accumulate(2) + clip_grad_norm_ in the user's loop, three AdamW steps,
    the loss logged after each (the routing statistics join it: a tracker and the project folder's file)."""
    from accelerate import Accelerator

    world, steps, accum = dist.get_world_size(), 3, 2
    ref, model = _reference(model_dir), _ep_model(model_dir, out / "art")
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    tracker = _recording_tracker()
    accelerator = hp_rewrite.prepare_accelerator(Accelerator(cpu=True, gradient_accumulation_steps=accum,
                                                             log_with=[tracker], project_dir=str(out / "acc_project")))
    accelerator.init_trackers("run")
    # the sampler a user writes for a fixed order: rank r takes every world-th micro-batch
    ids = torch.stack([s["input_ids"] for s in samples]).view(steps * accum, world, PER_DEVICE, SEQ)
    mine = ids[:, dist.get_rank()]
    optimizer = _adamw(model.parameters())
    ddp, optimizer = accelerator.prepare(model, optimizer)
    norms = []
    for batch in mine:
        with accelerator.accumulate(ddp):
            # mean over this micro-batch; accelerate divides by the accumulation steps
            loss = ddp(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(ddp.parameters(), 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            accelerator.log({"loss": loss.item()}, step=len(norms))
    hand = []
    ref_norms = _reference_steps(ref, samples, steps, PER_DEVICE * world * accum, _adamw(ref.parameters()), 0.5,
                                 hand)
    worst, name = _worst(model, ref)
    result = {"worst": worst, "worst_name": name, "norms": norms, "ref_norms": ref_norms,
              "wrapped": type(ddp).__name__, "hand_routing": hand,
              "routing": routing_logged(tracker.logged, out / "acc_project", steps)}
    # prepare_accelerator: save_state / load_state hold every rank's experts and their optimizer state,
    # save_model writes what plain transformers loads
    accelerator.save_state(str(out / "accelerate_state"))
    final = [p.detach().clone() for p in model.parameters()]
    batch = mine[0]
    ddp(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    accelerator.load_state(str(out / "accelerate_state"))
    result["state_worst"] = max((a.detach() - b).abs().max().item() for a, b in zip(model.parameters(), final, strict=True))
    accelerator.save_model(ddp, str(out / "accelerate_saved"))
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        result["reload_saved"] = _worst(model, AutoModelForCausalLM.from_pretrained(out / "accelerate_saved"))[0]
    return result


BIAS_RATE = 0.01


def _biases(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def _bias_setup(out: Path, steps: int, accum: int):
    """A tiny DeepSeek-V3 checkpoint (rank 0 writes it once), the unmodified model, a maker of the EP 2 one
    with routing.bias_update_rate, the samples of ``steps`` global batches and the biases at the start."""
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.tiny import make_tiny

    checkpoint = out / "deepseek_v3-tiny"
    if dist.get_rank() == 0 and not checkpoint.is_dir():
        make_tiny("deepseek_v3", checkpoint)
    dist.barrier()
    plan = parse_plan(f"version: 1\nep_size: 2\nrouting: {{bias_update_rate: {BIAS_RATE}}}\n")

    def ep_model():
        return hp_rewrite.from_pretrained(checkpoint, plan=plan, artifact_dir=out / "art_bias",
                                          attn_implementation="eager")

    ref = _reference(checkpoint)
    samples = _samples(ref.config.vocab_size, PER_DEVICE * dist.get_world_size() * accum * steps)
    return checkpoint, ref, ep_model, samples, _biases(ref)


def _bias_result(model, ref, start: dict) -> dict:
    got, want = _biases(model), _biases(ref)
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, {n: b.tolist() for n, b in got.items()})
    return {"biases_equal": bool(got) and got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want),
            "moved": [float((want[n] - b).abs().max()) for n, b in start.items()],
            "same_on_every_rank": all(d == digests[0] for d in digests), "worst": _worst(model, ref)[0]}


def case_trainer_bias_update(model_dir, out):
    """routing.bias_update_rate through Trainer at EP 2 (SGD, accumulation 2, a checkpoint each step):
    after three steps the selection biases are bitwise those of a hand update of the unmodified model
    from the global count of each step, and alike on every rank; resuming from checkpoint-1 ends with
    the same biases (the checkpoint held them); plain transformers reads them from save_model."""
    from transformers import AutoModelForCausalLM

    world, steps, accum = dist.get_world_size(), 3, 2
    checkpoint, ref, ep_model, samples, start = _bias_setup(out, steps, accum)
    model = ep_model()
    common = dict(learning_rate=0.5, max_steps=steps, gradient_accumulation_steps=accum, save_strategy="steps",
                  save_steps=1)
    trainer = _trainer(model, samples, out / "bias", **common)
    trainer.train()
    _reference_steps(ref, samples, steps, PER_DEVICE * world * accum, torch.optim.SGD(ref.parameters(), lr=0.5), 0.0,
                     [], BIAS_RATE)
    result = _bias_result(model, ref, start)
    trainer.save_model(str(out / "bias" / "final"))
    if dist.get_rank() == 0:
        plain = AutoModelForCausalLM.from_pretrained(out / "bias" / "final")
        result["reload_equal"] = all(torch.equal(b, _biases(ref)[n]) for n, b in _biases(plain).items())
    dist.barrier()
    resumed_model = ep_model()
    _trainer(resumed_model, samples, out / "bias", **common).train(resume_from_checkpoint=str(out / "bias" / "checkpoint-1"))
    result["resumed_equal"] = all(torch.equal(b, _biases(model)[n]) for n, b in _biases(resumed_model).items())
    return result


def case_accelerate_bias_update(model_dir, out):
    """routing.bias_update_rate through accelerate at EP 2 (accumulate(2), two SGD steps): the biases of a
    hand update; save_state, one more step, load_state puts the saved biases back."""
    from accelerate import Accelerator

    world, steps, accum = dist.get_world_size(), 2, 2
    _, ref, ep_model, samples, start = _bias_setup(out, steps, accum)
    model = ep_model()
    accelerator = hp_rewrite.prepare_accelerator(Accelerator(cpu=True, gradient_accumulation_steps=accum))
    ids = torch.stack([s["input_ids"] for s in samples]).view(steps * accum, world, PER_DEVICE, SEQ)
    prepared, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))

    def step(batch):
        with accelerator.accumulate(prepared):
            accelerator.backward(prepared(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()

    for batch in ids[:, dist.get_rank()]:
        step(batch)
    _reference_steps(ref, samples, steps, PER_DEVICE * world * accum, torch.optim.SGD(ref.parameters(), lr=0.5), 0.0,
                     [], BIAS_RATE)
    result = _bias_result(model, ref, start)
    saved = _biases(model)
    accelerator.save_state(str(out / "bias_state"))
    for batch in ids[:accum, dist.get_rank()]:
        step(batch)
    result["changed_after_save"] = any(not torch.equal(b, saved[n]) for n, b in _biases(model).items())
    accelerator.load_state(str(out / "bias_state"))
    result["restored"] = all(torch.equal(b, saved[n]) for n, b in _biases(model).items())
    return result


Z_COEF = 0.01


def _aux_models(model_dir, out: Path, runtime: str = ""):
    """The unmodified model (with a hand z-loss) and the EP 2 one with routing.aux_loss: global and
    routing.z_loss_coef (and ``runtime``, the plan's runtime section), both returning their load-balancing
    loss (output_router_logits)."""
    from transformers import AutoModelForCausalLM

    from hp_rewrite.plan import parse_plan

    plan = parse_plan(f"version: 1\nep_size: 2\nrouting: {{aux_loss: global, z_loss_coef: {Z_COEF}}}\n{runtime}")
    kwargs = dict(attn_implementation="eager", output_router_logits=True)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).train()
    ref.hp_z = z_loss_by_hand(ref)
    return ref, hp_rewrite.from_pretrained(model_dir, plan=plan, artifact_dir=out / "art_aux", **kwargs)


def _global_reference(ref, samples, steps: int, accum: int, lr: float) -> None:
    """SGD steps of the unmodified model, each over ``accum`` global micro-batches (every rank's
    micro-batch i, concatenated): its loss there, load-balancing term and z-loss included, averaged over them."""
    optimizer, size = torch.optim.SGD(ref.parameters(), lr=lr), len(samples) // (steps * accum)
    for step in range(steps):
        for i in range(accum):
            chunk = samples[(step * accum + i) * size : (step * accum + i + 1) * size]
            ids = torch.stack([s["input_ids"] for s in chunk])
            ((ref(input_ids=ids, labels=ids).loss + Z_COEF * ref.hp_z()) / accum).backward()
        optimizer.step()
        optimizer.zero_grad()


def case_loop_global_aux(model_dir, out):
    """routing.aux_loss: global and routing.z_loss_coef in a hand-written DDP loop at EP 2 (two steps of
    two micro-batches, padded rows masked): the unmodified model's steps on the concatenated micro-batches
    of both ranks, with the z-loss by hand; the aux_loss every rank reports is the global micro-batch's,
    not its own."""
    from torch.nn.parallel import DistributedDataParallel

    world, rank, steps, accum = dist.get_world_size(), dist.get_rank(), 2, 2
    ref, model = _aux_models(model_dir, out)
    ddp = DistributedDataParallel(model)
    optimizer, ref_optimizer = torch.optim.SGD(model.parameters(), lr=1.0), torch.optim.SGD(ref.parameters(), lr=1.0)
    ids = torch.stack([s["input_ids"] for s in _samples(ref.config.vocab_size, steps * accum * world * PER_DEVICE)])
    ids = ids.view(steps, accum, world * PER_DEVICE, SEQ)
    mask = torch.ones(world * PER_DEVICE, SEQ, dtype=torch.long)
    mask[::PER_DEVICE, :3] = 0  # each rank's first row starts with 3 padding tokens: the same count on every rank
    module = sys.modules[type(ref).__module__]
    reported, local, wanted = [], [], []
    for step in range(steps):
        for i in range(accum):
            batch = ids[step, i]
            labels = batch.masked_fill(mask == 0, -100)
            mine = slice(rank * PER_DEVICE, (rank + 1) * PER_DEVICE)
            got = ddp(input_ids=batch[mine], attention_mask=mask[mine], labels=labels[mine])
            (got.loss / accum).backward()
            want = ref(input_ids=batch, attention_mask=mask, labels=labels)
            ((want.loss + Z_COEF * ref.hp_z(mask)) / accum).backward()
            reported.append(got.aux_loss.item())
            wanted.append(want.aux_loss.item())
            local.append(float(module.load_balancing_loss_func(got.router_logits, 8, 2, mask[mine])))
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    worst, name = _worst(model, ref)
    return {"worst": worst, "worst_name": name, "reported": reported, "wanted": wanted, "local": local}


def case_trainer_global_aux(model_dir, out):
    """routing.aux_loss: global through Trainer at EP 2 (two SGD steps, accumulation 2): the unmodified model
    stepped on the global micro-batches (Trainer's own weighting of the per-rank term, ranks x steps, is
    not applied to the global one)."""
    world, steps, accum = dist.get_world_size(), 2, 2
    ref, model = _aux_models(model_dir, out)
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    _trainer(model, samples, out / "global_aux", max_steps=steps, gradient_accumulation_steps=accum,
             gradient_checkpointing=True).train()
    _global_reference(ref, samples, steps, accum, 1.0)
    worst, name = _worst(model, ref)
    return {"worst": worst, "worst_name": name}


def case_sft_global_aux(model_dir, out):
    """routing.aux_loss: global through TRL's SFTTrainer at EP 2 with its defaults (activation
    checkpointing, the load-balancing loss from the config's coefficient; SGD, fp32), and runtime.balance
    forced on (any imbalance, any piece moves): the unmodified model stepped on the global micro-batches."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hp_rewrite.runtime import installed
    from tests.fsdp_engine_script import _tokenizer

    world, steps, accum = dist.get_world_size(), 2, 2
    ref, model = _aux_models(model_dir, out, "runtime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1}\n")
    guests = []
    for _, holder in installed.holders(model):  # what each forward lent (checkpointing's recomputations too)
        holder.register_forward_hook(lambda m, *_: guests.append(installed.last_stats(m).guests))
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    args = SFTConfig(output_dir=str(out / "sft_global_aux"), per_device_train_batch_size=PER_DEVICE, use_cpu=True,
                     report_to=[], bf16=False, logging_steps=1, save_strategy="no", max_steps=steps,
                     gradient_accumulation_steps=accum, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
                     max_grad_norm=0.0, train_sampling_strategy="sequential", seed=0, dataloader_drop_last=True,
                     disable_tqdm=True)
    data = Dataset.from_dict({"input_ids": [s["input_ids"].tolist() for s in samples]})
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer(ref.config.vocab_size))
    hp_rewrite.prepare_trainer(trainer).train()
    _global_reference(ref, samples, steps, accum, 1.0)
    worst, name = _worst(model, ref)
    return {"worst": worst, "worst_name": name, "checkpointing": args.gradient_checkpointing,
            "aux_loss": trainer.aux_loss_enabled, "guests": sum(guests)}


def case_trainer_compile(model_dir, out):
    """Trainer(torch_compile=True): the compiled expert-parallel model, one SGD step."""
    world = dist.get_world_size()
    ref, model = _reference(model_dir), _ep_model(model_dir, out / "art")
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world)
    trainer = _trainer(model, samples, out / "compile", torch_compile=True, torch_compile_backend="aot_eager")
    trainer.train()
    _reference_steps(ref, samples, 1, PER_DEVICE * world, torch.optim.SGD(ref.parameters(), lr=1.0), 0.0)
    worst, name = _worst(model, ref)
    return {"worst": worst, "worst_name": name}


def case_trainer_unprepared(model_dir, out):
    """A Trainer not passed to prepare_trainer saves from rank 0 alone: refused there, clearly."""
    from transformers import Trainer, TrainingArguments

    from hp_rewrite.runtime.errors import ExpertParallelError

    model = _ep_model(model_dir, out / "art")
    args = TrainingArguments(output_dir=str(out / "unprepared"), use_cpu=True, ddp_backend="gloo", report_to=[])
    trainer = Trainer(model=model, args=args)
    try:
        trainer.save_model()
    except ExpertParallelError as e:
        return {"error": str(e)}
    return {"error": ""}


def case_trainer_refusals(model_dir, out):
    """prepare_trainer refuses what it cannot make exact: DeepSpeed; attention-only adapters need
    nothing from it (FSDP: tests/fsdp_engine_script.py)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments


    args = dict(output_dir=str(out / "refusals"), use_cpu=True, ddp_backend="gloo", report_to=[])
    result = {"plain": _refusal(Trainer(model=_reference(model_dir), args=TrainingArguments(**args)))}
    attention = get_peft_model(_ep_model(model_dir, out / "art"), LoraConfig(r=2, target_modules=["q_proj"]))
    trainer = Trainer(model=attention, args=TrainingArguments(**args))
    result["peft_attention"] = _refusal(trainer)
    result["peft_attention_untouched"] = getattr(trainer, "hp_rewrite_callback", None) is None
    deepspeed = Trainer(model=_ep_model(model_dir, out / "art"), args=TrainingArguments(**args))
    deepspeed.is_deepspeed_enabled = True  # what Trainer sets for a DeepSpeed config (deepspeed is not installed)
    result["deepspeed"] = _refusal(deepspeed)
    del AutoModelForCausalLM
    return result


def run_cases(cases: dict, folder_per_case: bool = False) -> None:
    """``MODEL_DIR OUT_DIR CASE [CASE ...]`` from the command line: each ``case_<CASE>`` of ``cases``
    (a script's globals) on every rank, its result in ``OUT_DIR/<CASE>-rank<r>.json``."""
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for case in sys.argv[3:]:
        result = cases[f"case_{case}"](model_dir, out / case if folder_per_case else out)
        (out / f"{case}-rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    run_cases(globals())


if __name__ == "__main__":
    main()
