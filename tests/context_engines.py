"""Context parallelism (and TP-extended EP, ``SPLIT="tp_size"``) through the engines users launch: TRL's
SFTTrainer and GRPOTrainer, accelerate.

The reference is the unmodified model under the same engine, each context group's ranks fed one batch
(what DDP makes of duplicated data-parallel ranks is the data-parallel step itself: means and counts
gathered over the world count every batch ``cp_size`` times, and cancel). Its data loaders are shared
the way ``prepare_trainer`` shares the expert-parallel model's; the cases assert that the ranks of a
context group did get one batch and the groups different ones, so the sharing itself is checked too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

import hp_rewrite
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime.binding.install import expert_weights, local_rows
from hp_rewrite.tiny import tiny_tokenizer
from hp_rewrite.training.batches import share_batches
from tests.context_cases import reference

CP = 2


def _models(out_dir: str, ep: int = 2, split: str = "cp_size"):
    """The rewritten model with ``split`` (``cp_size``, ``tp_size`` or both: ``tp_size+cp_size``) 2, and the
    unmodified one."""
    ref = reference({"model_type": "qwen3_moe"}, torch.float32)  # router logits on: the aux loss in the loss
    sizes = "".join(f"{field}: {CP}\n" for field in split.split("+"))
    model = rewrite_model(copy.deepcopy(ref), parse_plan(f"version: 1\nep_size: {ep}\n{sizes}"),
                          artifact_dir=Path(out_dir))
    return model, ref


def _group(split: str) -> int:
    """How many ranks hold one batch."""
    return CP ** len(split.split("+"))


def _first_batches(model) -> list:
    """The first input ids each forward of the decoder sees, and the length its layers run on."""
    seen = []
    decoder = model.get_decoder()

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and len(seen) < 2:
            seen.append(int(ids.sum()))

    decoder.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def _layer_lengths(model) -> list:
    lengths = []
    model.get_decoder().layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(int(kwargs.get("hidden_states", args[0] if args else None).shape[1])),
        with_kwargs=True)
    return lengths


def _worst_after(model, ref, before: dict) -> dict:
    """The largest difference of the two models' weights after training, relative to each weight's largest
    value (each rank's experts against their rows), and how far the reference moved on the same scale
    (so the comparison is not of two models that did not train)."""
    weights = expert_weights(model)
    ref_params = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in ref.named_parameters()}
    worst, worst_name, moved = 0.0, "", 0.0
    for name, p in model.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "")  # FSDP2's activation checkpointing wrapper
        value, target, start = _full(p), _full(ref_params[name]), before[name]
        if name in weights and target.shape != value.shape:  # each rank's experts: their rows
            target, start = local_rows(*weights[name], target), local_rows(*weights[name], start)
        scale = target.abs().max().clamp_min(1e-12)
        err = ((value - target).abs().max() / scale).item()
        moved = max(moved, ((target - start).abs().max() / scale).item())
        if err > worst:
            worst, worst_name = err, name
    return {"worst": worst, "worst_name": worst_name, "moved": moved}


def _full(p) -> torch.Tensor:
    """A parameter's value whole (an FSDP2 shard gathered: collective), detached."""
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _logs(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.startswith("moe/") and "runtime" not in k and "per_second" not in k
             and k not in ("epoch", "step", "total_flos", "train_loss", "step_time")} for h in trainer.state.log_history]


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # accelerate's own CPU path (DDP), after the forced FSDP cases


def case_context_sft(model_dir: str, out_dir: str) -> dict:
    """TRL's SFTTrainer (activation checkpointing on, its default; fp32 for an exact comparison; SGD so the
    update is the clipped gradient) for two steps of 2 accumulated micro-batches of sequences of different
    lengths (padding, ``num_items_in_batch``), on the context-parallel model, prepared, and the reference."""
    _reset_accelerate()
    return context_sft(out_dir)


def case_tp_sft(model_dir: str, out_dir: str) -> dict:
    """:func:`case_context_sft` on a model split over TP groups of 2 (EP 2): trained without DDP, the slices'
    gradients reduced by the engine guard, clipped by the global norm."""
    _reset_accelerate()
    return context_sft(out_dir, split="tp_size")


def case_tp_cp_sft(model_dir: str, out_dir: str) -> dict:
    """:func:`case_context_sft` with TP groups of 2 and context groups of 2: the 4 ranks hold one batch."""
    _reset_accelerate()
    return context_sft(out_dir, split="tp_size+cp_size")


def context_sft(out_dir: str, trainer_class=None, split: str = "cp_size", **config) -> dict:
    """:func:`case_context_sft` with SFTTrainer wrapped by ``trainer_class`` and more SFTConfig ``config``
    (FSDP2: tests/fsdp_engine_script.py), the model split by ``split``."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, ref = _models(str(Path(out_dir) / f"art-sft-{split}"), split=split)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    vocab = ref.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    world = dist.get_world_size()
    samples = [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(9, 15, (2 * 2 * 2 * world // _group(split),), generator=gen)]
    data = Dataset.from_dict({"input_ids": samples})
    result = {}
    for name, m in (("ep", model), ("ref", ref)):
        firsts, lengths = _first_batches(m), _layer_lengths(m)
        args = SFTConfig(output_dir=str(Path(out_dir) / f"sft-{split}-{name}"), per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, max_steps=2, bf16=False, use_cpu=True, report_to=[],
                         logging_steps=1, save_strategy="no", optim="sgd", learning_rate=0.05,
                         train_sampling_strategy="sequential", seed=0, dataloader_drop_last=True, disable_tqdm=True,
                         **config)
        trainer = (trainer_class or SFTTrainer)(model=m, args=args, train_dataset=data,
                                                processing_class=tiny_tokenizer(vocab))
        if name == "ep":
            hp_rewrite.prepare_trainer(trainer)
        else:  # the reference: each context group's ranks fed one batch, as the prepared trainer feeds them
            share_batches(trainer.accelerator, _group(split), "reference")
        trainer.train()
        result[name] = {"logs": _logs(trainer), "firsts": firsts, "lengths": lengths[:1],
                        "checkpointing": trainer.args.gradient_checkpointing,
                        "fsdp2": type(trainer.model).__name__.startswith("FSDP"),
                        "total_batch": trainer.get_total_train_batch_size(trainer.args)}
        if name == "ep":
            model = trainer.model
        else:
            ref = trainer.model
    return {**result, **_worst_after(model, ref, before)}


def case_tp_grpo(model_dir: str, out_dir: str) -> dict:
    """:func:`case_context_grpo` on a model split over TP groups of 2: a TP group samples as its first rank
    does at every step (its dense parts combine its ranks' activations)."""
    return case_context_grpo(model_dir, out_dir, split="tp_size")


def case_context_grpo(model_dir: str, out_dir: str, split: str = "cp_size") -> dict:
    """TRL's GRPOTrainer (GRPOConfig's defaults: checkpointing, sampling at temperature 1, the generated batch
    shuffled; fp32) for one step. Each rank samples with its own random stream; a context group trains on
    its first rank's completions in its first rank's order, so the reference's generate does the same (its
    ranks' own samples would make it a run of 4 different batches)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from hp_rewrite.sync.generation import install_lockstep_generation

    _reset_accelerate()
    model, ref = _models(str(Path(out_dir) / f"art-grpo-{split}"), split=split)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    install_lockstep_generation(ref, True, model.hp_rewrite.ep.batch_group)
    vocab = ref.config.vocab_size
    gen = torch.Generator().manual_seed(21)
    prompts = [" ".join(f"t{i}" for i in torch.randint(3, vocab, (4,), generator=gen).tolist()) for _ in range(8)]

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    result = {}
    for name, m in (("ep", model), ("ref", ref)):
        firsts, lengths = _first_batches(m), _layer_lengths(m)
        args = GRPOConfig(output_dir=str(Path(out_dir) / f"grpo-{split}-{name}"), per_device_train_batch_size=2,
                          num_generations=2, max_completion_length=6, max_steps=1, learning_rate=1e-3,
                          adam_epsilon=1e-4, bf16=False, use_cpu=True, report_to=[], logging_steps=1,
                          save_strategy="no", seed=0, disable_tqdm=True)
        trainer = GRPOTrainer(model=m, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=tiny_tokenizer(vocab))
        if name == "ep":
            hp_rewrite.prepare_trainer(trainer)
        else:
            share_batches(trainer.accelerator, CP, "reference")
        trainer.train()
        result[name] = {"logs": _logs(trainer), "firsts": firsts, "lengths": lengths[-1:],
                        "checkpointing": trainer.args.gradient_checkpointing}
    return {**result, **_worst_after(model, ref, before)}


def case_context_grpo_vllm(model_dir: str, out_dir: str) -> dict:
    """GRPOTrainer generating with vLLM colocated (TRL's real VLLMGeneration over tests/vllm_standin.py's
    engine), the context-parallel model loaded as users load it (``hp_rewrite.from_pretrained`` with a
    ``cp_size: 2`` plan) against the unmodified checkpoint, one step. Each rank's engine samples its own
    stream (as vLLM seeded by rank does); a context group trains on its first rank's completions, so the
    reference's engine output is shared the same way."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from hp_rewrite.training.batches import share_engine_generations
    from tests.vllm_standin import vllm_standin

    _reset_accelerate()
    plan = Path(out_dir) / "cp2.yaml"
    if dist.get_rank() == 0:
        plan.parent.mkdir(parents=True, exist_ok=True)
        plan.write_text(f"version: 1\nep_size: 2\ncp_size: {CP}\n")
    dist.barrier()
    model = hp_rewrite.from_pretrained(model_dir, plan=plan, artifact_dir=Path(out_dir) / "art-vllm")
    ref = AutoModelForCausalLM.from_pretrained(model_dir).train()
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    vocab = ref.config.vocab_size
    gen = torch.Generator().manual_seed(23)
    prompts = [" ".join(f"t{i}" for i in torch.randint(3, vocab, (4,), generator=gen).tolist()) for _ in range(8)]
    result = {}
    for name, m in (("ep", model), ("ref", ref)):
        firsts, lengths = _first_batches(m), _layer_lengths(m)
        args = GRPOConfig(output_dir=str(Path(out_dir) / f"grpo-vllm-{name}"), per_device_train_batch_size=2,
                          num_generations=2, max_completion_length=5, max_steps=1, learning_rate=1e-3,
                          adam_epsilon=1e-4, use_vllm=True, vllm_mode="colocate", bf16=False, use_cpu=True,
                          report_to=[], logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True)
        with vllm_standin():
            trainer = GRPOTrainer(model=m, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                                  args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                                  processing_class=tiny_tokenizer(vocab))
            trainer.vllm_generation.llm.returned.extend([None] * dist.get_rank())  # each rank's own seed
            if name == "ep":
                hp_rewrite.prepare_trainer(trainer)
            else:
                share_batches(trainer.accelerator, CP, "reference")
                share_engine_generations(trainer, model.hp_rewrite.ep.cp_group)
            trainer.train()
        result[name] = {"logs": _logs(trainer), "firsts": firsts, "lengths": lengths[-1:],
                        "checkpointing": trainer.args.gradient_checkpointing}
    return {**result, **_worst_after(model, ref, before)}


def case_context_accelerate_refusal(model_dir: str, out_dir: str) -> dict:
    """accelerate's own context parallelism on an expert-parallel model: refused with the plan field."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig

    from hp_rewrite.runtime.errors import ExpertParallelError

    _reset_accelerate()  # a GPU machine's distributed type, which accelerate's ParallelismConfig needs (it refuses
    PartialState(cpu=True)  # MULTI_CPU before hp-rewrite is asked); the device and the backend stay gloo's
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    try:
        accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=CP),
                                  fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    except ValueError as e:  # accelerate refuses it on this machine before hp-rewrite is asked
        return {"message": f"accelerate: {e}"}
    try:
        hp_rewrite.prepare_accelerator(accelerator)
        message = ""
    except ExpertParallelError as e:
        message = str(e)
    return {"message": message, "tp_fsdp": _tp_under_engine_fsdp(out_dir)}


def _tp_under_engine_fsdp(out_dir: str) -> str:
    """accelerate's FSDP2 plugin around a model split over TP groups: refused (not yet supported), by name."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from hp_rewrite.runtime.errors import ExpertParallelError

    _reset_accelerate()
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    try:
        model, _ = _models(str(Path(out_dir) / "art-tp-fsdp"), split="tp_size")
        accelerator = hp_rewrite.prepare_accelerator(Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2)))
        accelerator.prepare(model)
    except ExpertParallelError as e:
        return str(e)
    finally:
        _reset_accelerate()
    return ""


def case_tp_accelerate(model_dir: str, out_dir: str) -> dict:
    """:func:`case_context_accelerate` on a model split over TP groups of 2 (EP 4 over two of them)."""
    return case_context_accelerate(model_dir, out_dir, split="tp_size")


def case_context_accelerate(model_dir: str, out_dir: str, split: str = "cp_size") -> dict:
    """A prepared Accelerator's DDP loop: its data loader gives each context group one batch, and one
    optimizer step matches the unmodified model's under the same loop."""
    from accelerate import Accelerator

    _reset_accelerate()
    model, ref = _models(str(Path(out_dir) / f"art-accelerate-{split}"), ep=4, split=split)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(3, ref.config.vocab_size, (4 * dist.get_world_size() // CP, 10), generator=gen)
    result = {}
    for name, m in (("ep", model), ("ref", ref)):
        firsts, lengths = _first_batches(m), _layer_lengths(m)
        accelerator = Accelerator(cpu=True)
        if name == "ep":
            hp_rewrite.prepare_accelerator(accelerator)
        else:
            share_batches(accelerator, CP, "reference")
        loader = torch.utils.data.DataLoader(ids, batch_size=2)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.05)
        wrapped, optimizer, loader = accelerator.prepare(m, optimizer, loader)
        for batch in loader:
            out = wrapped(input_ids=batch, labels=batch)
            accelerator.backward(out.loss)
        norm = accelerator.clip_grad_norm_(wrapped.parameters(), 1.0)
        optimizer.step()
        result[name] = {"firsts": firsts, "lengths": lengths[:1], "norm": float(norm), "batches": len(loader)}
    return {**result, **_worst_after(model, ref, before)}
