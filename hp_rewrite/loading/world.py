"""The world a plan runs in, whatever the load order.

Users load the model first and build ``TrainingArguments`` / ``GRPOConfig`` (which start the process group)
after. Under a launcher (torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR``) whose process group is not
started yet, a parallel plan starts it, as transformers does for ``from_pretrained(tp_plan=...)``: the
device's backend, and the 30 minutes Trainer, TRL and accelerate would have started it with, so the
engines built later use it (to choose another timeout, start the group before loading). With no launcher
and no process group a parallel plan is refused, unless the call asks for one process in so many words
(``single_process=True``): never a model that says it is expert-parallel and is not.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..hf import transformers_logger
from ..runtime.errors import ExpertParallelError

# what torch.distributed's env:// initialisation reads; torchrun (and other launchers) set them all
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# the collective backend of each accelerator (as transformers' tensor parallelism chooses it); the CPU: gloo
BACKENDS = {"cuda": "nccl", "npu": "hccl", "xpu": "xccl"}


def launched() -> bool:
    """This process was started by a launcher of a distributed job (its variables are all set)."""
    return all(v in os.environ for v in LAUNCHER_VARIABLES)


def device_type() -> str:
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator.type if accelerator is not None else "cpu"


# the timeout Trainer, TRL and accelerate start the world with (TrainingArguments.ddp_timeout's default): the
# load now starts it in their place, so their default holds, not torch's shorter one for NCCL (10 minutes)
WORLD_TIMEOUT = timedelta(seconds=1800)


def start_launched_world() -> str:
    """Start the default process group from the launcher's variables: the device's backend, the engines'
    default timeout, this process's accelerator the one of its local rank. Returns the backend."""
    kind = device_type()
    if kind != "cpu":
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", 0)))
    backend = BACKENDS.get(kind, "gloo")
    dist.init_process_group(backend, timeout=WORLD_TIMEOUT)
    return backend


def parallel_sizes(plan) -> str:
    return (f"ep_size={plan.ep_size}" + (f" and tp_size={plan.tp_size}" if plan.tp_size > 1 else "")
            + (f" and cp_size={plan.cp_size}" if plan.cp_size > 1 else ""))


def ensure_world(plan, single_process: bool = False) -> bool:
    """Whether ``plan`` runs over a ``torch.distributed`` world: True when one is initialised (started here
    under a launcher if the plan is parallel and none was yet); False for one process, which a parallel plan
    is only with ``single_process=True`` (logged: the model is then not expert-parallel)."""
    parallel = plan.ep_size > 1 or plan.tp_size > 1 or plan.cp_size > 1
    if single_process:
        if parallel:
            transformers_logger("hp_rewrite").warning(
                f"hp-rewrite: single_process=True: the plan's {parallel_sizes(plan)} is not applied, this model "
                "is loaded whole in this process and is not expert-parallel")
        return False
    if dist.is_available() and dist.is_initialized():
        return True
    if not parallel:
        return False
    if launched():
        start_launched_world()
        return True
    raise ExpertParallelError(
        f"the plan asks for {parallel_sizes(plan)}, but this process was not started by a distributed launcher "
        "and torch.distributed is not initialised: launch it with torchrun --nproc-per-node N (N a multiple of "
        f"{max(plan.ep_size, plan.tp_size, plan.cp_size)}), or pass single_process=True to load the model whole in this "
        "process, not expert-parallel (for inspection or a notebook)")
