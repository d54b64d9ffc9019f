"""Data-parallel memory and communication of a whole model: replicated (DDP) or ``fully_shard``.

The per-layer model (:mod:`per_rank`) costs the MoE layers of one EP rank. This adds what the data
parallel dimension decides, for every parameter of the model:

* ``replicate`` (DDP, Trainer, accelerate): every rank holds every non-expert weight and its
  experts' ``E / ep``; gradients are all-reduced, the non-expert ones over the world, the experts'
  over their ``world / ep`` replicas (ring all-reduce: ``2 (n - 1) / n`` of the bytes each way);
* ``fully_shard`` (:func:`hp_rewrite.fully_shard`): non-expert weights are sharded over the world,
  experts over their replicas; per step every weight is all-gathered twice (forward, and again in
  backward after ``reshard_after_forward``) and every gradient reduce-scattered once
  (``(n - 1) / n`` of the bytes each).

States per parameter are :attr:`Precision.state_bytes` (weight, gradient, Adam moments, fp32 master
copy in 16-bit training). The collectives run beside the compute (FSDP prefetches, DDP buckets), so
they add to the step only where they take longer than it: ``exposed = max(0, dp_time - compute)``,
a lower bound on what an imperfect overlap costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware
from .per_rank import ModelCost, Precision

MODES = ("replicate", "fully_shard")


@dataclass(frozen=True)
class DataParallelCost:
    mode: str
    world: int
    ep: int
    expert_state_bytes: float  # this rank's experts, every MoE layer
    other_state_bytes: float  # everything else: attention, embeddings, norms, routers, shared experts
    comm_bytes: float  # per step, sent by this rank (all-gathers + reduce-scatters, or all-reduces)
    comm_s: float

    @property
    def state_bytes(self) -> float:
        return self.expert_state_bytes + self.other_state_bytes


def _collective_time(bytes_: float, ranks: int, hw: Hardware) -> float:
    """Ring collective of ``bytes_`` (already the per-rank share) among ``ranks`` ranks: the intra-node
    bandwidth when the group fits in a node, else the inter-node one."""
    if ranks <= 1 or bytes_ <= 0:
        return 0.0
    beta = hw.beta_Bps if ranks <= hw.devices_per_node else hw.beta_inter_Bps
    alpha = hw.alpha_s if ranks <= hw.devices_per_node else hw.alpha_inter_s
    return alpha * (ranks - 1) + bytes_ / beta


def data_parallel_cost(cost: ModelCost, world: int, mode: str, hw: Hardware,
                       prec: Precision | None = None) -> DataParallelCost:
    """Per-rank states and data-parallel traffic of the whole model costed in ``cost`` at ``world`` ranks."""
    if mode not in MODES:
        raise ValueError(f"data parallel mode {mode!r}: choose one of {', '.join(MODES)}")
    ep = cost.parallel.ep
    if world < 1 or world % ep:
        raise ValueError(f"world size {world} is not a multiple of ep {ep}")
    prec = prec or cost.precision
    replicas = world // ep
    tp = cost.parallel.tp
    dense = world // tp  # the ranks holding the same TP shard of a dense weight
    per_param = prec.state_bytes
    if prec.lora_rank:
        return _lora_cost(cost, world, mode, hw, prec)
    expert_params = sum(c.memory.expert_params for c in cost.layers) / prec.param  # this EP rank's
    # with tp the dense weights are split over the TP group (embeddings and norms counted as split too:
    # an upper bound on what tp saves); the routers' and shared experts' are already this rank's share
    other_params = cost.other_params / tp + sum(c.memory.replicated_params for c in cost.layers) / prec.param
    if mode == "fully_shard":
        expert_states = expert_params * per_param / replicas
        other_states = other_params * per_param / dense
        gathered = 2 * prec.param  # all-gather in forward and again in backward
        expert_bytes = (gathered + prec.grad) * expert_params * (replicas - 1) / replicas
        other_bytes = (gathered + prec.grad) * other_params * (dense - 1) / dense
    else:
        expert_states = expert_params * per_param
        other_states = other_params * per_param
        expert_bytes = 2 * prec.grad * expert_params * (replicas - 1) / replicas
        other_bytes = 2 * prec.grad * other_params * (dense - 1) / dense
    seconds = _collective_time(expert_bytes, replicas, hw) + _collective_time(other_bytes, dense, hw)
    return DataParallelCost(mode, world, ep, expert_states, other_states, expert_bytes + other_bytes, seconds)


def _lora_cost(cost: ModelCost, world: int, mode: str, hw: Hardware, prec: Precision) -> DataParallelCost:
    """A frozen base with LoRA on the experts, replicated (FSDP2 over PEFT adapters is refused): every
    weight held as loaded, the experts' adapters' gradients all-reduced over their replicas."""
    if mode != "replicate":
        raise ValueError("LoRA (--lora) is costed replicated only: FSDP2 with PEFT adapters on the experts is "
                         "refused; use --non-expert replicate")
    ep, tp = cost.parallel.ep, cost.parallel.tp
    replicas = world // ep
    expert_states = sum(c.memory.expert_params + c.memory.expert_grads + c.memory.expert_optimizer
                        for c in cost.layers)
    other_states = cost.other_params / tp * prec.param + sum(c.memory.replicated_params for c in cost.layers)
    adapter_grads = sum(c.memory.expert_grads for c in cost.layers)  # fp32
    comm = 2 * adapter_grads * (replicas - 1) / replicas
    return DataParallelCost(mode, world, ep, expert_states, other_states, comm, _collective_time(comm, replicas, hw))
