"""FSDP2 through the engines users launch, under torchrun (launched by tests/test_fsdp_engines.py):

    torchrun --standalone --nproc-per-node N tests/fsdp_engine_script.py MODEL_DIR OUT_DIR CASE [CASE ...]

On a CPU accelerate silently replaces FSDP by DDP (``MULTI_CPU``) and drops the plugin. Each case
makes accelerate take its real FSDP2 path (``force_fsdp``: the state's distributed type is set as a
GPU machine sets it, before the Accelerator is built, so accelerate's own FSDP branch runs and keeps
the plugin) and asserts that the model came back as an FSDP2 module, experts over the expert-replica
mesh. The expert-parallel model (``hp_rewrite.from_pretrained``) is compared with the unmodified
transformers model: stepped by hand on the concatenated batch (fp32), or trained by the same engine
under the same FSDP2 policy (bf16, and the load-balancing loss, which is not additive over ranks).
Every rank writes ``OUT_DIR/<case>-rank<r>.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hp_rewrite  # noqa: E402
from hp_rewrite.runtime.binding.install import expert_weights, local_rows  # noqa: E402
from tests.context_engines import (  # noqa: E402, F401 (cases run by name)
    case_context_accelerate,
    case_context_accelerate_refusal,
    case_context_grpo,
    case_context_grpo_vllm,
    case_context_sft,
    case_tp_accelerate,
    case_tp_cp_sft,
    case_tp_grpo,
    case_tp_sft,
)
from tests.engine_cases import _error, lent_or_guests  # noqa: E402
from tests.engine_script import (  # noqa: E402
    PER_DEVICE,
    SEQ,
    _adamw,
    _reference_steps,
    _samples,
    routing_logged,
    run_cases,
)

LAYER = "Qwen3MoeDecoderLayer"


def force_fsdp() -> None:
    """accelerate's FSDP branch on a CPU: the distributed type a GPU machine gets, set before the
    Accelerator (or Trainer) builds its state; the device, backend and world stay gloo's."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(True)  # a fresh state: the case before may have built one
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worst(model, ref) -> tuple[float, str]:
    """Worst relative difference of the parameters, sharded ones gathered (collective); each rank's
    experts against their rows of the unmodified model's."""
    weights = expert_weights(model)
    ref_params = dict(ref.named_parameters())
    worst = (0.0, "")
    for name, p in model.named_parameters():
        ref_name = name.replace("._checkpoint_wrapped_module", "")  # activation checkpointing's wrapper
        value, target = _full(p.detach()).float(), _full(ref_params[ref_name].detach()).float()
        if name in weights and target.shape != value.shape:
            target = local_rows(*weights[name], target)
        err = ((value - target).abs().max() / target.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, (err, name))
    return worst


def _sharding(model) -> dict:
    """How the model came back: FSDP2 root, the experts' and the dense weights' meshes."""
    from torch.distributed.fsdp import FSDPModule

    weights = expert_weights(model)
    expert = next(p for n, p in model.named_parameters() if n in weights)
    dense = model.get_input_embeddings().weight
    return {"fsdp2": isinstance(model, FSDPModule), "class": type(model).__name__,
            "expert_mesh": expert.device_mesh.size() if hasattr(expert, "device_mesh") else 0,
            "dense_mesh": dense.device_mesh.size() if hasattr(dense, "device_mesh") else 0,
            "expert_local_rows": expert.to_local().shape[0] if hasattr(expert, "to_local") else -1}


def _ep_model(model_dir: str, out: Path, dtype=None, balanced: bool = False):
    """The model at EP 2 (plans/auto-ep2.yaml); ``balanced``: with runtime.balance forced on (any
    imbalance, any piece moves), so that every layer lends rows."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    plan = _balanced_plan(out) if balanced else ROOT / "plans" / "auto-ep2.yaml"
    return hp_rewrite.from_pretrained(model_dir, plan=plan, artifact_dir=out / "art", attn_implementation="eager",
                                      **kwargs)


def _balanced_plan(out: Path) -> Path:
    """EP 2 with runtime.balance forced on (any imbalance, any piece moves), written by rank 0."""
    plan = out / "balanced-ep2.yaml"
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        plan.write_text("version: 1\nep_size: 2\nruntime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1}\n")
    dist.barrier()
    return plan


def _reference(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").train()


def _params(model) -> list[torch.Tensor]:
    return [_full(p.detach()).clone() for p in model.parameters()]


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b, strict=True))


def case_accelerate(model_dir, out):
    """Accelerator(fsdp_plugin=FSDP2 by layer class, cpu_ram_efficient_loading) + prepare_accelerator:
    three AdamW steps with accumulation 2 and clipping against the unmodified model; save_state after
    the first step, then load_state and the last two steps again end bit for bit where they ended;
    save_model / get_state_dict give the unmodified model's tensors."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    force_fsdp()
    world, rank, steps, accum = dist.get_world_size(), dist.get_rank(), 3, 2
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[LAYER], reshard_after_forward=True,
                                            cpu_ram_efficient_loading=True, state_dict_type="SHARDED_STATE_DICT")
    accelerator = hp_rewrite.prepare_accelerator(Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=accum))
    ref, model = _reference(model_dir), _ep_model(model_dir, out)
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    ids = torch.stack([s["input_ids"] for s in samples]).view(steps * accum, world, PER_DEVICE, SEQ)
    mine = ids[:, rank]
    optimizer = _adamw(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    result = {"distributed_type": str(accelerator.distributed_type), **_sharding(model),
              "is_fsdp": accelerator.distributed_type == DistributedType.FSDP}
    norms = []

    def micro_step(batch):
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 0.5) if accelerator.sync_gradients else None
            optimizer.step()
            optimizer.zero_grad()
        return norm

    for i, batch in enumerate(mine):
        norm = micro_step(batch)
        if norm is not None:
            norms.append(float(_full(norm)))
        if i == accum - 1:
            accelerator.save_state(str(out / "state"))
    ref_norms = _reference_steps(ref, samples, steps, PER_DEVICE * world * accum, _adamw(ref.parameters()), 0.5)
    result["worst"], result["worst_name"] = _worst(model, ref)
    result["norms"], result["ref_norms"] = norms, ref_norms
    final = _params(model)
    accelerator.load_state(str(out / "state"))
    for batch in mine[accum:]:
        micro_step(batch)
    result["resume_worst"] = _diff(_params(model), final)
    result["state_files"] = sorted(os.listdir(out / "state"))
    full = accelerator.get_state_dict(model)
    accelerator.save_model(model, str(out / "saved"))
    if rank == 0:
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(out / "saved", attn_implementation="eager")
        plain_sd = plain.state_dict()
        result["saved_keys_equal"] = sorted(plain_sd) == sorted(ref.state_dict())
        result["saved_worst"] = _worst(plain, ref)[0]
        result["state_dict_worst"] = max(((full[n] - plain_sd[n]).abs().max() / plain_sd[n].abs().max()
                                          .clamp_min(1e-12)).item() for n in plain_sd)
    return result


def case_accelerate_lora(model_dir, out, presharded: bool = False):
    """accelerate's FSDP2 plugin, PEFT LoRA on attention and the experts: two AdamW steps with accumulation
    2 and clipping against the unmodified PEFT model; save_state after the first, load_state and the second
    step again ends bit for bit where it ended; the state holds the adapter plain PEFT reads.
    ``presharded``: the user sharded the PEFT model with hp_rewrite.fully_shard before ``prepare``, which
    keeps it as it is."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from peft import LoraConfig, PeftModel, get_peft_model

    from tests.engine_script import _lora_state, _lora_worst, _own_expert_adapters

    force_fsdp()
    world, rank, steps, accum = dist.get_world_size(), dist.get_rank(), 2, 2
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[LAYER], reshard_after_forward=True)
    accelerator = hp_rewrite.prepare_accelerator(Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=accum))
    config = dict(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    ref = get_peft_model(_reference(model_dir), LoraConfig(**config))
    torch.manual_seed(5)
    model = get_peft_model(_ep_model(model_dir, out), LoraConfig(**config))
    _own_expert_adapters(model)
    ref.load_state_dict(_lora_state(model), strict=False)
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    mine = torch.stack([s["input_ids"] for s in samples]).view(steps * accum, world, PER_DEVICE, SEQ)[:, rank]
    if presharded:
        hp_rewrite.fully_shard(model)
    sharded = dict(model.named_parameters())
    prepared, optimizer = accelerator.prepare(model, _adamw([p for p in model.parameters() if p.requires_grad]))
    norms = []

    def micro_step(batch):
        with accelerator.accumulate(prepared):
            accelerator.backward(prepared(input_ids=batch, labels=batch).loss)
            if accelerator.sync_gradients:
                norms.append(float(_full(accelerator.clip_grad_norm_(prepared.parameters(), 0.5))))
            optimizer.step()
            optimizer.zero_grad()

    for i, batch in enumerate(mine):
        micro_step(batch)
        if i == accum - 1:
            accelerator.save_state(str(out / "state"))
    ref_norms = _reference_steps(ref, samples, steps, PER_DEVICE * world * accum,
                                 _adamw([p for p in ref.parameters() if p.requires_grad]), 0.5)
    result = {"worst": _lora_worst(model, ref), "worst_name": "lora", "norms": list(norms), "ref_norms": ref_norms,
              "is_fsdp": True, **_sharding(prepared),
              "kept": all(p is sharded[n] for n, p in prepared.named_parameters())}
    final = _params(prepared)
    accelerator.load_state(str(out / "state"))
    for batch in mine[accum:]:
        micro_step(batch)
    result["resume_worst"] = _diff(_params(prepared), final)
    result["state_files"] = sorted(os.listdir(out / "state" / "hp_rewrite_adapter_0"))
    if rank == 0:  # the state's adapter, read by plain PEFT: the adapters after the first step
        plain = PeftModel.from_pretrained(_reference(model_dir), out / "state" / "hp_rewrite_adapter_0")
        result["state_adapter_keys"] = sorted(_lora_state(plain)) == sorted(_lora_state(ref))
    return result


def case_accelerate_lora_presharded(model_dir, out):
    return case_accelerate_lora(model_dir, out, presharded=True)


def _forced_trainer_class(base):
    """``base`` (Trainer, SFTTrainer) taking accelerate's FSDP path on a CPU (module doc)."""

    class Forced(base):
        def create_accelerator_and_postprocess(self):
            force_fsdp()
            super().create_accelerator_and_postprocess()

    return Forced


def _fsdp_config(state_dict_type: str = "FULL_STATE_DICT") -> dict:
    return {"fsdp_version": 2, "transformer_layer_cls_to_wrap": [LAYER], "state_dict_type": state_dict_type,
            "reshard_after_forward": True}


def _trainer(model, samples, out_dir, **overrides):
    from transformers import Trainer, TrainingArguments

    args = dict(output_dir=str(out_dir), per_device_train_batch_size=PER_DEVICE, use_cpu=True, report_to=[],
                fsdp=True, fsdp_config=_fsdp_config(), optim="sgd", learning_rate=1.0,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, max_steps=1, save_strategy="no",
                logging_steps=1, train_sampling_strategy="sequential", dataloader_drop_last=True, seed=0,
                disable_tqdm=True)
    args.update(overrides)
    trainer = _forced_trainer_class(Trainer)(model=model, args=TrainingArguments(**args), train_dataset=samples)
    return hp_rewrite.prepare_trainer(trainer)


def _grad_norms(trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def case_trainer_global_aux(model_dir, out):
    """routing.aux_loss: global through Trainer under FSDP2 with activation checkpointing (two SGD steps,
    accumulation 2): the unmodified model stepped on the concatenated micro-batches of every rank."""
    from tests.engine_script import _aux_models, _global_reference

    world, steps, accum = dist.get_world_size(), 2, 2
    ref, model = _aux_models(model_dir, out)
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    trainer = _trainer(model, samples, out / "global_aux", max_steps=steps, gradient_accumulation_steps=accum,
                       fsdp_config={**_fsdp_config(), "activation_checkpointing": True})
    trainer.train()
    _global_reference(ref, samples, steps, accum, 1.0)
    worst, name = _worst(trainer.model, ref)
    return {"worst": worst, "worst_name": name, "is_fsdp": trainer.is_fsdp_enabled, **_sharding(trainer.model)}


def case_trainer_sgd(model_dir, out):
    """One SGD step at lr 1 with clipping (a gradient or norm off by any factor moves the weights by it),
    with fsdp_config's activation checkpointing (accelerate wraps the layers after the experts are sharded)."""
    world = dist.get_world_size()
    ref, model = _reference(model_dir), _ep_model(model_dir, out)
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world)
    common = dict(max_grad_norm=0.5, fsdp_config={**_fsdp_config(), "activation_checkpointing": True},
                  save_strategy="steps", save_steps=1)
    trainer = _trainer(model, samples, out / "sgd", **common)
    trainer.train()
    norms = _reference_steps(ref, samples, 1, PER_DEVICE * world, torch.optim.SGD(ref.parameters(), lr=1.0), 0.5)
    worst, name = _worst(trainer.model, ref)
    layer = type(trainer.model.model.layers[0]).__name__
    result = {"worst": worst, "worst_name": name, "grad_norm": _grad_norms(trainer), "ref_norms": norms,
              "is_fsdp": trainer.is_fsdp_enabled, **_sharding(trainer.model), "layer_class": layer}
    trainer.save_model(str(out / "final"))  # names under the checkpoint wrapper: saved as transformers names them
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        result["reload_final"] = _worst(AutoModelForCausalLM.from_pretrained(out / "final"), ref)[0]
    resumed = _trainer(_ep_model(model_dir, out), samples, out / "sgd", **common)  # checkpoint-1: nothing left
    resumed.train(resume_from_checkpoint=str(out / "sgd" / "checkpoint-1"))
    result["resume_worst"] = _diff(_params(resumed.model), _params(trainer.model))
    return result


def _trainer_adamw(model_dir, out, state_dict_type: str) -> dict:
    """Three AdamW steps with gradient_accumulation_steps=2 and clipping, a checkpoint after each, then
    save_model; a second Trainer resumes from checkpoint-1 and ends where the first did."""
    from transformers import AutoModelForCausalLM

    world, steps, accum = dist.get_world_size(), 3, 2
    ref, model = _reference(model_dir), _ep_model(model_dir, out)
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    common = dict(optim="adamw_torch", learning_rate=1e-3, adam_epsilon=1e-4, weight_decay=0.0, max_steps=steps,
                  gradient_accumulation_steps=accum, max_grad_norm=0.5, save_strategy="steps", save_steps=1,
                  fsdp_config=_fsdp_config(state_dict_type))
    trainer = _trainer(model, samples, out / "run", **common)
    trainer.train()
    hand = []
    norms = _reference_steps(ref, samples, steps, PER_DEVICE * world * accum, _adamw(ref.parameters()), 0.5, hand)
    worst, name = _worst(trainer.model, ref)
    final = _params(trainer.model)
    trainer.save_model(str(out / "final"))
    result = {"worst": worst, "worst_name": name, "grad_norm": _grad_norms(trainer), "ref_norms": norms,
              "hand_routing": hand, "routing": routing_logged(trainer, out / "run", steps),
              "is_fsdp": trainer.is_fsdp_enabled, **_sharding(trainer.model),
              "files": sorted(os.listdir(out / "run" / "checkpoint-1"))}
    if dist.get_rank() == 0:  # save_model: a checkpoint plain transformers loads, equal to the unmodified model
        plain = AutoModelForCausalLM.from_pretrained(out / "final", attn_implementation="eager")
        result["reload_final"] = _worst(plain, ref)[0]
        if state_dict_type == "FULL_STATE_DICT":
            plain = AutoModelForCausalLM.from_pretrained(out / "run" / "checkpoint-3", attn_implementation="eager")
            result["reload_checkpoint"] = _worst(plain, ref)[0]
    dist.barrier()
    resumed = _trainer(_ep_model(model_dir, out), samples, out / "run", **common)
    resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-1"))
    result["resume_worst"] = _diff(_params(resumed.model), final)
    result["resumed_norms"] = _grad_norms(resumed)
    return result


def case_trainer_lora_experts(model_dir, out, kept_fp8: bool = False):
    """PEFT LoRA on the experts only (target_parameters) with fsdp_config version 2: three AdamW steps
    with accumulation 2 and clipping, a checkpoint after each, against the unmodified PEFT model stepped
    on the concatenated batch; the adapters sharded with their experts over the expert replicas;
    save_model and checkpoints hold the adapter plain PEFT reads; a second Trainer resumes from
    checkpoint-1 and ends where the first did. ``kept_fp8``: a DeepSeek-V3 block-FP8 checkpoint with its
    experts kept as codes (FSDP2 leaves them out), LoRA on every Linear too, runtime.balance forced on (the
    codes and the adapters' factors travel), against the unmodified model loaded with ``dequantize=True``."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from tests.engine_script import (
        _dequantised_fp8,
        _fp8_checkpoint,
        _kept_fp8_model,
        _lora_state,
        _lora_worst,
        _own_expert_adapters,
    )

    world, steps, accum = dist.get_world_size(), 3, 2
    config = dict(r=2, lora_alpha=4, init_lora_weights=False,
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    load_ep, load_ref = _ep_model, _reference
    if kept_fp8:
        config["target_modules"] = "all-linear"
        model_dir, load_ref = _fp8_checkpoint(out), _dequantised_fp8
        load_ep = lambda d, o: _kept_fp8_model(d, o / "art", _balanced_plan(o))  # noqa: E731 (balanced, #61)
    ref = get_peft_model(load_ref(model_dir), LoraConfig(**config))
    torch.manual_seed(5)  # replicated adapters alike on every rank
    model = get_peft_model(load_ep(model_dir, out), LoraConfig(**config))
    _own_expert_adapters(model)
    ref.load_state_dict(_lora_state(model), strict=False)  # the same adapters, full shape
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world * accum * steps)
    common = dict(optim="adamw_torch", learning_rate=1e-3, adam_epsilon=1e-4, weight_decay=0.0, max_steps=steps,
                  gradient_accumulation_steps=accum, max_grad_norm=0.5, save_strategy="steps", save_steps=1)
    if kept_fp8:
        common["fsdp_config"] = {**_fsdp_config(), "transformer_layer_cls_to_wrap": ["DeepseekV3DecoderLayer"]}
    trainer = _trainer(model, samples, out / "lora", **common)
    trainer.train()
    ref_norms = _reference_steps(ref, samples, steps, PER_DEVICE * world * accum,
                                 _adamw([p for p in ref.parameters() if p.requires_grad]), 0.5)
    adapter = next(p for n, p in model.named_parameters() if ".experts." in n and "lora_A" in n)
    result = {"worst": _lora_worst(model, ref), "worst_name": "lora", "grad_norm": _grad_norms(trainer),
              "ref_norms": ref_norms, "is_fsdp": trainer.is_fsdp_enabled, **_sharding(trainer.model),
              "adapter_mesh": adapter.device_mesh.size(), "adapter_rows": [adapter.to_local().shape[0], adapter.shape[0]],
              "lent_or_guests": lent_or_guests(trainer.model)}
    trainer.save_model(str(out / "lora" / "final"))
    want = _lora_state(model)
    if dist.get_rank() == 0:  # plain transformers + PEFT read the adapter the run wrote
        for folder in ("final", "checkpoint-3"):
            got = _lora_state(PeftModel.from_pretrained(load_ref(model_dir), out / "lora" / folder))
            result[f"reload_{folder}"] = max((got[k] - want[k]).abs().max().item() for k in want)
        result["files"] = sorted(os.listdir(out / "lora" / "checkpoint-1"))
    dist.barrier()
    torch.manual_seed(99)
    resumed_model = get_peft_model(load_ep(model_dir, out), LoraConfig(**config))
    resumed = _trainer(resumed_model, samples, out / "lora", **common)
    resumed.train(resume_from_checkpoint=str(out / "lora" / "checkpoint-1"))
    result["resume_worst"] = _lora_worst(resumed_model, model)
    if kept_fp8:
        from hp_rewrite.runtime.compute.quantized import QuantizedWeight

        result["codes_kept"] = sum(isinstance(p, QuantizedWeight) for p in model.parameters())
    return result


def case_trainer_lora_fp8_kept(model_dir, out):
    return case_trainer_lora_experts(model_dir, out, kept_fp8=True)


def case_context_sft_fsdp(model_dir, out):
    """tests/context_engines.py's SFTTrainer case (cp_size 2 x 2 data-parallel ranks) with fsdp_config
    version 2: FSDP2 over the data x context ranks, against the unmodified model under the same."""
    from trl import SFTTrainer

    from tests.context_engines import context_sft

    return context_sft(out, _forced_trainer_class(SFTTrainer), fsdp=True, fsdp_config=_fsdp_config())


def case_ddp_trainer_lora(model_dir, out):
    """The DDP Trainer case of tests/engine_script.py (LoRA on attention and the experts: DDP around the
    model, the guard reducing the expert adapters), here in the 4-rank world: EP 2 x 2 data-parallel
    replicas, each EP rank's adapters trained by two ranks."""
    from accelerate.state import AcceleratorState

    from tests.engine_script import case_trainer_lora_attention_experts

    AcceleratorState._reset_state(True)  # accelerate's own CPU path (DDP), after the forced FSDP cases
    return case_trainer_lora_attention_experts(model_dir, out)


def case_trainer_full(model_dir, out):
    return _trainer_adamw(model_dir, out, "FULL_STATE_DICT")


def case_trainer_sharded(model_dir, out):
    return _trainer_adamw(model_dir, out, "SHARDED_STATE_DICT")


def _tokenizer(vocab: int):
    """A word-level tokenizer over the tiny vocabulary (SFTTrainer needs a processing class)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t0")),
                                   pad_token="t1", eos_token="t2")


def _sft(model, samples, out_dir, bf16: bool, **overrides):
    """TRL's SFTTrainer with SFTConfig's defaults (activation checkpointing, the load-balancing loss,
    bf16 unless ``bf16`` is False) and fsdp_config version 2."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"input_ids": [s["input_ids"].tolist() for s in samples]})
    options = dict(max_steps=3, gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-3,
                   adam_epsilon=1e-4)
    options.update(overrides)
    args = SFTConfig(output_dir=str(out_dir), per_device_train_batch_size=PER_DEVICE, use_cpu=True, report_to=[],
                     fsdp=True, fsdp_config=_fsdp_config(), bf16=bf16, logging_steps=1, save_strategy="no",
                     train_sampling_strategy="sequential", seed=0, dataloader_drop_last=True, disable_tqdm=True,
                     **options)
    trainer = _forced_trainer_class(SFTTrainer)(model=model, args=args, train_dataset=data,
                                                processing_class=_tokenizer(model.config.vocab_size))
    return trainer, args


def _sft_case(model_dir, out, bf16: bool, balanced: bool = False, **overrides) -> dict:
    """SFTTrainer on the expert-parallel model against SFTTrainer on the unmodified model, the same
    arguments and FSDP2 (the load-balancing loss is per rank's micro-batch, as in any data parallelism)."""
    world = dist.get_world_size()
    model = _ep_model(model_dir, out, balanced=balanced)
    samples = _samples(model.config.vocab_size, PER_DEVICE * world * 2 * 3)
    trainer, args = _sft(model, samples, out / "ep", bf16, **overrides)
    hp_rewrite.prepare_trainer(trainer)
    trainer.train()
    result = {"is_fsdp": trainer.is_fsdp_enabled, **_sharding(trainer.model), "bf16": args.bf16,
              "checkpointing": args.gradient_checkpointing, "aux_loss": trainer.aux_loss_enabled,
              "mp_param_dtype": str(trainer.accelerator.state.fsdp_plugin.mixed_precision_policy.param_dtype)
              if trainer.accelerator.state.fsdp_plugin.mixed_precision_policy else "None",
              "lent_or_guests": lent_or_guests(trainer.model)}
    ep_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ref_trainer, _ = _sft(_reference(model_dir), samples, out / "ref", bf16, **overrides)
    ref_trainer.train()
    result["worst"], result["worst_name"] = _worst(trainer.model, ref_trainer.model)
    result["losses"] = ep_losses
    result["ref_losses"] = [h["loss"] for h in ref_trainer.state.log_history if "loss" in h]
    result["grad_norm"], result["ref_norms"] = _grad_norms(trainer), _grad_norms(ref_trainer)
    return result


def case_sft(model_dir, out):
    return _sft_case(model_dir, out, bf16=False)


def case_sft_sgd(model_dir, out):
    """One SGD step at lr 1, with runtime.balance forced on (every layer lends rows)."""
    return _sft_case(model_dir, out, bf16=False, balanced=True, optim="sgd", learning_rate=1.0, max_steps=1,
                     gradient_accumulation_steps=1)


def case_sft_bf16(model_dir, out):
    return _sft_case(model_dir, out, bf16=True, max_steps=2, gradient_accumulation_steps=1)


def _lora_worst(model, ref, part: str = "") -> tuple[float, str]:
    """Worst relative difference of the LoRA tensors (``part`` in their names), the reference's FSDP2 shards
    gathered, the expert-parallel model's expert adapters gathered."""
    from tests.engine_script import _lora_state

    got = _lora_state(model)
    want = {k.removeprefix("module."): _full(v).detach() for k, v in ref.state_dict().items() if "lora_" in k}
    assert sorted(got) == sorted(want), (sorted(got)[:3], sorted(want)[:3])
    return max((((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)).item(), k) for k in want
               if part in k)


def case_sft_lora_bf16(model_dir, out):
    """SFTTrainer with SFTConfig's defaults (bf16, activation checkpointing, the load-balancing loss) and
    fsdp_config version 2, LoRA on attention and the experts (PEFT's init), against SFTTrainer on the
    unmodified PEFT model under the same FSDP2 policy; save_model writes the adapter plain PEFT reads."""
    from tests.engine_script import _lora_pair, _plain_peft_reads

    world = dist.get_world_size()
    config = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model, ref = _lora_pair(_ep_model(model_dir, out), _reference(model_dir), config)
    samples = _samples(model.config.vocab_size, PER_DEVICE * world * 2)
    options = dict(max_steps=2, gradient_accumulation_steps=1)
    trainer, args = _sft(model, samples, out / "ep", True, **options)
    hp_rewrite.prepare_trainer(trainer)
    trainer.train()
    ref_trainer, _ = _sft(ref, samples, out / "ref", True, **options)
    ref_trainer.train()
    result = {"is_fsdp": trainer.is_fsdp_enabled, **_sharding(trainer.model), "bf16": args.bf16,
              "checkpointing": args.gradient_checkpointing, "aux_loss": trainer.aux_loss_enabled,
              **dict(zip(("worst", "worst_name"), _lora_worst(model, ref_trainer.model), strict=True)),
              "experts_worst": _lora_worst(model, ref_trainer.model, ".experts.")[0],
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "ref_losses": [h["loss"] for h in ref_trainer.state.log_history if "loss" in h]}
    trainer.save_model(str(out / "ep" / "final"))
    result.update(_plain_peft_reads(model, model_dir, {"final": out / "ep" / "final"}))
    return result


def _accelerate_sgd(model_dir, out, presharded: bool) -> dict:
    """One SGD step at lr 1 with clipping through accelerate's FSDP2 (here with reshard_after_forward
    False), with runtime.balance forced on; ``presharded``: the user sharded the model (balance off) with
    hp_rewrite.fully_shard before prepare, and accelerate keeps it as it is."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    force_fsdp()
    world, rank = dist.get_world_size(), dist.get_rank()
    accelerator = hp_rewrite.prepare_accelerator(Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=False)))
    ref, model = _reference(model_dir), _ep_model(model_dir, out, balanced=not presharded)
    if presharded:
        hp_rewrite.fully_shard(model)
    sharded = {n: p for n, p in model.named_parameters()}
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    samples = _samples(ref.config.vocab_size, PER_DEVICE * world)
    ids = torch.stack([s["input_ids"] for s in samples]).view(world, PER_DEVICE, SEQ)[rank]
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    norm = float(_full(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
    optimizer.step()
    ref_norms = _reference_steps(ref, samples, 1, PER_DEVICE * world, torch.optim.SGD(ref.parameters(), lr=1.0), 0.5)
    worst, name = _worst(model, ref)
    kept = all(p is sharded[n] for n, p in model.named_parameters())
    return {"worst": worst, "worst_name": name, "norms": [norm], "ref_norms": ref_norms, "kept": kept,
            "is_fsdp": True, **_sharding(model), "lent_or_guests": lent_or_guests(model)}


def case_accelerate_sgd(model_dir, out):
    return _accelerate_sgd(model_dir, out, presharded=False)


def case_accelerate_presharded(model_dir, out):
    return _accelerate_sgd(model_dir, out, presharded=True)


def case_grpo(model_dir, out):
    """TRL's GRPOTrainer with fsdp_config version 2 (transformers generating, in lockstep: FSDP modules
    turn synced_gpus on; GRPOConfig's defaults, fp32) and runtime.balance forced on, one step on the expert-parallel model (prepared)
    against the unmodified model under the same FSDP2 policy, the same prompts and seed: the same logs
    (the same completions) and the same weights after the step."""
    from tests.engine_script import _grpo_both

    trainers, logs = _grpo_both(model_dir, out / "grpo", {"ref": _reference(model_dir),
                                                          "ep": _ep_model(model_dir, out, balanced=True)},
                                trainer_class=_forced_trainer_class, fsdp=True, fsdp_config=_fsdp_config())
    ep, ref = trainers["ep"], trainers["ref"]
    worst, worst_name = _worst(ep.model, ref.model)
    start = _reference(model_dir)
    moved = max((_full(p.detach()) - q).abs().max().item() for p, q in zip(ref.model.parameters(), start.parameters(),
                                                                           strict=True))
    return {"is_fsdp": ep.is_fsdp_enabled, **_sharding(ep.model), "worst": worst, "worst_name": worst_name,
            "logs": logs["ep"], "ref_logs": logs["ref"], "checkpointing": ep.args.gradient_checkpointing,
            "moved": moved, "lent_or_guests": lent_or_guests(ep.model)}


def case_grpo_lora(model_dir, out):
    """GRPOTrainer with fsdp_config version 2 and LoRA on attention and the experts (each rank's expert
    adapters its own draw) and runtime.balance forced on, one step (fp32) against the unmodified PEFT model
    with the same adapters under the same FSDP2 policy: the same logs and the same adapters after the step."""

    from tests.engine_script import _grpo_both, _lora_pair, _lora_state

    config = dict(r=2, lora_alpha=4, target_modules=["q_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model, ref = _lora_pair(_ep_model(model_dir, out, balanced=True), _reference(model_dir), config)
    before = _lora_state(ref)
    trainers, logs = _grpo_both(model_dir, out / "grpo_lora", {"ref": ref, "ep": model},
                                trainer_class=_forced_trainer_class, fsdp=True, fsdp_config=_fsdp_config())
    after = {k.removeprefix("module."): _full(v).detach() for k, v in trainers["ref"].model.state_dict().items()
             if "lora_" in k}
    worst, worst_name = _lora_worst(model, trainers["ref"].model)
    return {"is_fsdp": trainers["ep"].is_fsdp_enabled, **_sharding(trainers["ep"].model),
            "worst": worst, "worst_name": worst_name, "moved": max((after[k] - before[k]).abs().max().item() for k in before),
            "logs": logs["ep"], "ref_logs": logs["ref"], "checkpointing": trainers["ep"].args.gradient_checkpointing,
            "lent_or_guests": lent_or_guests(trainers["ep"].model)}


def case_refusals(model_dir, out):
    """What cannot be exact ends in a clear error: accelerate's FSDP2 without prepare_accelerator (at the
    first forward, before any step; the plugin's default wrap policy shards only the root, whose FSDP2
    unshards the experts before the guard runs), a model with weights on the meta device (accelerate's
    rank-0 broadcast would fill them), FSDP1 through accelerate and Trainer, DeepSpeed."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    result = {}
    force_fsdp()
    plain = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = _ep_model(model_dir, out)
    model, _ = plain.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    result["unprepared"] = _error(lambda: model(input_ids=ids))
    AcceleratorState._reset_state(True)
    force_fsdp()
    prepared = hp_rewrite.prepare_accelerator(Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)))
    empty = _ep_model(model_dir, out)
    empty.lm_head.weight = torch.nn.Parameter(torch.empty_like(empty.lm_head.weight, device="meta"))
    result["meta"] = _error(lambda: prepared.prepare(empty, torch.optim.SGD(empty.parameters(), lr=1.0)))
    AcceleratorState._reset_state(True)
    force_fsdp()
    fsdp1 = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))
    result["fsdp1"] = _error(lambda: hp_rewrite.prepare_accelerator(fsdp1))
    fsdp1.state.distributed_type = DistributedType.DEEPSPEED  # what accelerate holds for a DeepSpeed config
    result["deepspeed"] = _error(lambda: hp_rewrite.prepare_accelerator(fsdp1))
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out / "fsdp1"), use_cpu=True, report_to=[], fsdp=True,
                             fsdp_config=_fsdp_config())
    trainer = _forced_trainer_class(Trainer)(model=_ep_model(model_dir, out), args=args)
    # what Trainer holds for fsdp_config version 1, whose plugin needs a GPU to be built
    trainer.accelerator.state.fsdp_plugin.fsdp_version = 1
    result["trainer_fsdp1"] = _error(lambda: hp_rewrite.prepare_trainer(trainer))
    best = TrainingArguments(output_dir=str(out / "best"), use_cpu=True, report_to=[], fsdp=True,
                             fsdp_config=_fsdp_config(), load_best_model_at_end=True, eval_strategy="steps",
                             save_strategy="steps")
    samples = _samples(8, 2)
    trainer = _forced_trainer_class(Trainer)(model=_ep_model(model_dir, out), args=best, eval_dataset=samples)
    result["best_model"] = _error(lambda: hp_rewrite.prepare_trainer(trainer))
    # PEFT under fsdp_config: a trainable weight outside the adapter (its checkpoints hold the adapter
    # only), and adapters put in without PEFT's PeftModel (PEFT's inject_adapter_in_model; transformers'
    # add_adapter wants a newer PEFT than the one installed)
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    saving = TrainingArguments(output_dir=str(out / "peft"), use_cpu=True, report_to=[], fsdp=True,
                               fsdp_config=_fsdp_config(), save_strategy="steps")
    lora = get_peft_model(_ep_model(model_dir, out), LoraConfig(r=2, target_modules=["q_proj"]))
    lora.base_model.model.model.layers[0].mlp.gate.weight.requires_grad_(True)
    trainer = _forced_trainer_class(Trainer)(model=lora, args=saving)
    result["peft_unsaved"] = _error(lambda: hp_rewrite.prepare_trainer(trainer))
    added = inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]), _ep_model(model_dir, out))
    trainer = _forced_trainer_class(Trainer)(model=added, args=saving)
    result["add_adapter"] = _error(lambda: hp_rewrite.prepare_trainer(trainer))
    AcceleratorState._reset_state(True)
    return result


def main() -> None:
    run_cases(globals(), folder_per_case=True)


if __name__ == "__main__":
    main()
