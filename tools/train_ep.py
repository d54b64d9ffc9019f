"""Fine-tune a MoE checkpoint expert-parallel for a few steps through one of the engines users train
with (example; CPU + gloo here, the same code on GPUs with nccl):

    hp-rewrite make-tiny qwen3_moe /tmp/tiny
    torchrun --standalone --nproc-per-node 2 tools/train_ep.py /tmp/tiny --engine trainer

--engine loop        a hand-written loop, hp_rewrite.sync_gradients after backward
--engine ddp         the same loop around torch's DistributedDataParallel
--engine trainer     transformers Trainer (prepare_trainer: collective saves, resumable checkpoints)
--engine accelerate  Accelerator.prepare + accumulate + clip_grad_norm_
--engine fsdp2       hp_rewrite.fully_shard (experts over their replicas, the rest over the world),
                     hp_rewrite.clip_grad_norm_, a torch.distributed.checkpoint at the end
--engine accelerate-fsdp2   accelerate's FSDP2 plugin (prepare_accelerator), save_state at the end
--engine trainer-fsdp2      Trainer with fsdp_config version 2 (prepare_trainer), a checkpoint, save_model
--engine sft-fsdp2          TRL's SFTTrainer with its defaults (bf16, activation checkpointing, the
                            load-balancing loss) and fsdp_config version 2

On a machine without GPUs accelerate would silently train the FSDP2 variants with DDP; there this
example makes accelerate take its FSDP path (gloo, CPU tensors), as the tests do.
"""

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hp_rewrite

SEQ, BATCH = 32, 2


def batches(vocab: int, steps: int, rank: int):
    data = torch.Generator().manual_seed(rank)  # every rank its own batch (data parallel)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=data) for _ in range(steps)]


def report(step: int, loss: torch.Tensor) -> None:
    dist.all_reduce(mean := loss.detach().clone(), op=dist.ReduceOp.AVG)
    if dist.get_rank() == 0:
        print(f"step {step}: loss {mean.item():.4f}", flush=True)


def loop(model, args) -> None:
    ddp = torch.nn.parallel.DistributedDataParallel(model) if args.engine == "ddp" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, ids in enumerate(batches(model.config.vocab_size, args.steps, dist.get_rank())):
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.engine == "loop":
            hp_rewrite.sync_gradients(model)  # DDP does this itself (with hp-rewrite's expert reduction)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm: each expert once
        optimizer.step()
        optimizer.zero_grad()
        report(step, loss)


def fsdp2(model, args) -> None:
    hp_rewrite.fully_shard(model)  # over the mesh the EP groups came from: ("efsdp", "ep")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, ids in enumerate(batches(model.config.vocab_size, args.steps, dist.get_rank())):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # FSDP2 reduce-scatters: every gradient final here
        hp_rewrite.clip_grad_norm_(model.parameters(), 1.0)  # torch's own refuses two meshes
        optimizer.step()
        optimizer.zero_grad()
        report(step, loss)
    hp_rewrite.save_checkpoint(model, optimizer, f"{args.output_dir}/dcp")  # resumable at another EP size


def accelerate(model, args) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step, ids in enumerate(batches(model.module.config.vocab_size, 2 * args.steps, dist.get_rank())):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if step % 2:
            report(step // 2, loss)


def force_fsdp_on_cpu() -> None:
    """accelerate's FSDP branch without GPUs (module doc): the distributed type a GPU machine gets."""
    if torch.cuda.is_available():
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


#: Trainer's fsdp_config: each decoder layer (its _no_split_modules class) a unit, sharded checkpoints
FSDP_CONFIG = {"fsdp_version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"}


def accelerate_fsdp2(model, args) -> None:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    force_fsdp_on_cpu()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            state_dict_type="SHARDED_STATE_DICT")
    accelerator = hp_rewrite.prepare_accelerator(Accelerator(fsdp_plugin=plugin))  # before prepare
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step, ids in enumerate(batches(model.config.vocab_size, args.steps, dist.get_rank())):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # every expert counted once
        optimizer.step()
        optimizer.zero_grad()
        report(step, loss)
    accelerator.save_state(f"{args.output_dir}/state")  # model and optimizer: one DCP, global experts


def _reporter():
    from transformers import TrainerCallback

    class Report(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}) and dist.get_rank() == 0:
                print(f"step {state.global_step - 1}: loss {logs['loss']:.4f}", flush=True)

    return Report()


def _tokenizer(model_dir: str, vocab: int):
    """The checkpoint's tokenizer; a word-level one over the vocabulary for a tiny checkpoint without one."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError):
        from tokenizers import Tokenizer, models

        words = {f"t{i}": i for i in range(vocab)}
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t0")),
                                       pad_token="t1", eos_token="t2")


def trainer(model, args) -> None:
    from transformers import Trainer, TrainingArguments

    rows = torch.cat(batches(model.config.vocab_size, args.steps, 0)).repeat(dist.get_world_size(), 1)
    common = dict(output_dir=args.output_dir, per_device_train_batch_size=BATCH, max_steps=args.steps,
                  learning_rate=1e-3, use_cpu=not torch.cuda.is_available(), report_to=[], logging_steps=1,
                  save_strategy="steps", save_steps=args.steps, disable_tqdm=True)
    if args.engine != "trainer":  # fsdp_config version 2: each layer's weights, the experts over their replicas
        common.update(fsdp=True, fsdp_config=FSDP_CONFIG)
    if args.engine == "sft-fsdp2":  # SFTConfig's own defaults otherwise: bf16, activation checkpointing, aux loss
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        targs = SFTConfig(**common)
        force_fsdp_on_cpu()
        t = SFTTrainer(model=model, args=targs, train_dataset=Dataset.from_dict({"input_ids": rows.tolist()}),
                       processing_class=_tokenizer(args.model_dir, model.config.vocab_size),
                       callbacks=[_reporter()])
    else:
        targs = TrainingArguments(**common, ddp_backend="gloo")
        if args.engine == "trainer-fsdp2":
            force_fsdp_on_cpu()
        data = [{"input_ids": r, "labels": r} for r in rows]
        t = Trainer(model=model, args=targs, train_dataset=data, callbacks=[_reporter()])
    hp_rewrite.prepare_trainer(t)  # every rank, before train()
    t.train()
    t.save_model()  # every rank: the experts are gathered, rank 0 writes a standard checkpoint


ENGINES = {"loop": loop, "ddp": loop, "trainer": trainer, "accelerate": accelerate, "fsdp2": fsdp2,
           "accelerate-fsdp2": accelerate_fsdp2, "trainer-fsdp2": trainer, "sft-fsdp2": trainer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--plan", default="plans/auto-ep2.yaml")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engine", choices=list(ENGINES), default="loop")
    parser.add_argument("--output-dir", default="/tmp/hp-rewrite-train-ep", help="trainer and fsdp2 checkpoints")
    args = parser.parse_args()
    # the model first, the engine after, as users write it: under torchrun the load starts the process group
    # (the device's backend: gloo here, nccl on GPUs) and every engine built later uses it
    with hp_rewrite.auto_patch(args.plan):  # from_pretrained returns the expert-parallel model
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, attn_implementation="eager")
    print(f"rank {dist.get_rank()} ({dist.get_backend()}): {model.hp_rewrite.summary}", flush=True)
    model.train()
    ENGINES[args.engine](model, args)
    dist.barrier()  # no rank closes its connections while a peer still has one of the last collectives in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
