"""One batch per context or TP group through the engines' data loaders.

With ``cp_size > 1`` the ranks of a context group (consecutive ranks) must hold the same batch: each
splits its sequences and the model gathers them back. So must the ranks of a TP group (``tp_size > 1``):
each holds a slice of every dense weight. accelerate shards a data loader over the ranks
it is told are data-parallel, and when the device mesh it shards by names a ``cp`` dimension it gives
the ranks along it the same batch (its own context parallelism's rule: ``rank // cp_size`` is the
data-parallel index). :func:`share_batches` gives one Accelerator's data loaders such a mesh,
``("dp_replicate", "cp")`` over consecutive ranks, without turning on accelerate's own context
parallelism (torch's ring attention), which would split the sequence a second time.

Everything else an engine does stays as it is: DDP and FSDP2 average the gradients over the whole
world, and a context rank's gradients come scaled by ``cp_size`` (:mod:`hp_rewrite.context`), so the
mean is the data-parallel mean of the groups' sums. A loss normalised by a count gathered over the world
(Trainer's ``num_items_in_batch``, TRL's) counts each group's tokens ``cp_size`` times and is multiplied
back by the world size, which cancels the same way.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..runtime.errors import ExpertParallelError
from ..sync.generation import first_ranks_output, first_ranks_random_state


def share_batches(accelerator, size: int, what: str) -> None:
    """Make ``accelerator``'s data loaders (those prepared from now on) give every ``size`` consecutive
    ranks (the plan's ``tp_size x cp_size``) one batch; refused by name where this accelerate cannot be told."""
    if size == 1 or getattr(accelerator, "hp_rewrite_batch_share", 1) == size:
        return
    world = accelerator.num_processes
    if dist.is_available() and dist.is_initialized() and world != dist.get_world_size():
        raise ExpertParallelError(
            f"{what}: the engine runs {world} process(es) but torch.distributed has {dist.get_world_size()} ranks, so "
            f"it cannot give each group of the plan's tp_size x cp_size ({size}) ranks one batch; launch with torchrun "
            "(accelerate reads the world from its environment)")
    if world % size:
        raise ExpertParallelError(f"{what}: {world} processes are not a multiple of the plan's tp_size x cp_size {size}")
    if not callable(getattr(accelerator, "_prepare_device_mesh", None)):
        raise ExpertParallelError(
            f"{what}: this accelerate version has no device mesh for its data loaders, so the ranks of a context or "
            "TP group would get different batches; use accelerate >= 1.10, or train in a loop whose sampler takes "
            f"num_replicas=world_size // {size}, rank=rank // {size}")
    # a ParallelismConfig of data-parallel dimensions only (tp / cp / sp are refused before) keeps its mesh
    # for FSDP2's sharding: the data loaders alone take this one
    mesh = init_device_mesh(accelerator.device.type, (world // size, size), mesh_dim_names=("dp_replicate", "cp"))
    accelerator._prepare_device_mesh = lambda: mesh
    accelerator.hp_rewrite_batch_share = size


def share_engine_generations(trainer, group) -> None:
    """TRL's vLLM generation (``use_vllm``, colocated or server) on a context-parallel (or TP) model: each rank's
    engine samples its own completions of the group's one batch of prompts (and a server hands each rank
    its slice of completions sampled for every rank's copy), so each rank returns the context (or TP) ``group``'s
    first rank's completions and takes its random state, as ``generate`` does (:mod:`hp_rewrite.sync.generation`)."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or getattr(generation, "hp_rewrite_context", False):
        return
    generate = generation.generate
    device = trainer.accelerator.device

    def generate_for_the_group(*args, **kwargs):
        out = first_ranks_output(generate(*args, **kwargs), group)
        first_ranks_random_state(group, device)
        return out

    generation.generate = generate_for_the_group
    generation.hp_rewrite_context = True
