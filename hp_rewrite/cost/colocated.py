"""Memory per GPU of RL with the inference engine on the same GPUs (TRL's GRPO, ``vllm_mode="colocate"``):
each thing the training side holds on its own line, beside the share of the GPU vLLM takes.

The lines, per rank:

* the routed experts this rank holds (every MoE layer; as held: kept MXFP4 / FP8 codes with ``--lora``);
* every other weight (attention, embeddings, norms, routers, shared experts; split by ``tp``);
* full fine-tuning: their gradients, and fp32 master weights and Adam's two moments (12 bytes a
  parameter; with the 16-bit weight and gradient, 16 bytes a parameter); all of it divided over the
  replicas with ``fully_shard``;
* LoRA: the adapters on the routed experts, fp32, with their gradients and AdamW moments (16 bytes a
  parameter);
* activations under activation checkpointing (GRPOConfig's and SFTConfig's default): each decoder layer
  keeps its input (``tokens x hidden``), and one layer at a time is recomputed (the largest MoE layer's
  saved tensors, :func:`~.per_rank.estimate`'s ``activations``);
* logits: ``tokens x vocab`` in fp32, as TRL takes the log-probabilities, and their gradient (every
  token of the micro-batch: TRL keeps only the completion's, so a bound);
* vLLM: ``vllm_gpu_memory_utilization`` of the device (its weights, KV cache and CUDA graphs live in it).

Not counted: an FSDP2 layer's all-gathered weights while it runs, the allocator's fragmentation, CUDA
context and NCCL buffers (a few GB): keep headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sharding import MODES


@dataclass(frozen=True)
class MemoryLine:
    name: str
    bytes: float
    note: str = ""


def colocated_rl_memory(cost, world: int, mode: str, vllm_fraction: float, capacity: float, hidden: int,
                        vocab: int, num_hidden_layers: int) -> list[MemoryLine]:
    """The per-rank lines of the module docstring for ``cost`` (:class:`~.per_rank.ModelCost`) at ``world``
    ranks, non-expert weights ``mode`` (``replicate`` | ``fully_shard``), vLLM given ``vllm_fraction`` of
    ``capacity`` bytes."""
    if mode not in MODES:
        raise ValueError(f"non-expert mode {mode!r}: choose one of {', '.join(MODES)}")
    if not 0 <= vllm_fraction < 1:
        raise ValueError(f"vllm_gpu_memory_utilization {vllm_fraction}: a fraction of the device in [0, 1)")
    prec, par, layers = cost.precision, cost.parallel, cost.layers
    if world < 1 or world % par.ep or world % par.tp:
        raise ValueError(f"world size {world} is not a multiple of ep {par.ep} and tp {par.tp}")
    replicas, dense = world // par.ep, world // par.tp
    other_params = cost.other_params / par.tp + sum(c.memory.replicated_params for c in layers) / prec.param
    lines = []
    if prec.lora_rank:
        if mode != "replicate":
            raise ValueError("LoRA is costed replicated only: FSDP2 over PEFT adapters on the experts is refused")
        adapters = sum(c.memory.expert_grads for c in layers)  # fp32: 4 bytes a parameter
        lines += [MemoryLine("routed experts, frozen", sum(c.memory.expert_params for c in layers) - adapters,
                             "this rank's, as held"),
                  MemoryLine("other weights, frozen", other_params * prec.param),
                  MemoryLine("LoRA adapters: weights, gradients, AdamW", adapters * 4, "fp32, 16 bytes a parameter")]
    else:
        shard = (replicas, dense) if mode == "fully_shard" else (1, 1)
        experts = sum(c.memory.expert_params for c in layers) / prec.param / shard[0]
        other = other_params / shard[1]
        sharded = mode == "fully_shard"
        lines += [MemoryLine("routed experts", experts * prec.param,
                             "this rank's, sharded over their replicas" if sharded else "this rank's"),
                  MemoryLine("other weights", other * prec.param, "sharded over the world" if sharded else "replicated"),
                  MemoryLine("gradients", (experts + other) * prec.grad),
                  MemoryLine("fp32 masters and Adam moments", (experts + other) * (prec.master + prec.optimizer),
                             f"{prec.state_bytes} bytes a parameter with weight and gradient")]
    tokens = cost.workload.tokens(par.cp) / (par.tp if par.sequence_parallel else 1)
    recompute = max((c.memory.activations for c in layers), default=0.0)
    lines += [MemoryLine("activations, checkpointed", num_hidden_layers * tokens * hidden * prec.act + recompute,
                         f"each layer's input, one layer recomputed ({cost.workload.micro_batch} x "
                         f"{cost.workload.seq_len} tokens)"),
              MemoryLine("logits and their gradient", 2 * cost.workload.tokens() * vocab * 4,
                         "fp32, every token (TRL keeps the completion's: a bound); the whole sequence's on every "
                         "rank of a context group"),
              MemoryLine("vLLM, colocated", vllm_fraction * capacity,
                         f"vllm_gpu_memory_utilization={vllm_fraction:g}: weights, KV cache")]
    return lines
