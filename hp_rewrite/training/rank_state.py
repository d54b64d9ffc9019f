"""What one rank saves for itself when its optimizer state differs from every other rank's: the
state of its own experts' adapters (and, under FSDP2, of its shard of every trainable tensor).

A PEFT run saves its adapter as PEFT does (one file, gathered); what Adam keeps per parameter is
saved beside it, one file per rank, as that rank holds it. Such a file resumes only onto the same
world size and the same experts per rank, which is checked, with the way out in the message.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..runtime import installed
from ..runtime.errors import ExpertParallelError


def load_active_adapter(peft, folder: Path, what: str) -> None:
    """The active adapter back from ``folder``, where PEFT's ``save_pretrained`` wrote it (an adapter
    not named ``default`` in its own sub-folder), through PEFT's ``load_adapter``: each rank keeps its
    experts' slices and its FSDP2 shards. Read to the host first (PEFT's default is the accelerator)."""
    name = peft.active_adapter
    source = Path(folder) if name == "default" else Path(folder) / name
    if not any((source / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ExpertParallelError(
            f"{what}: {source} has no adapter_model.safetensors for the active adapter {name!r}; resume from a "
            "checkpoint written by a Trainer or Accelerator prepared by hp-rewrite"
        )
    peft.load_adapter(source, adapter_name=name, is_trainable=True, torch_device="cpu")


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def expert_layout(model) -> list[list[int]]:
    """Which experts this rank holds, per experts holder: a saved state resumes only onto the same."""
    return [list(installed.binding(m).placement.local_experts) for m in model.modules()
            if installed.binding(m) is not None]


def write_atomically(obj, path: Path) -> Path:
    """``torch.save`` into a temporary file beside ``path``, then renamed: never a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _flat_params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _shards(optimizer) -> list:
    """How each parameter is split (FSDP2's mesh shape and placements; None when whole)."""
    return [[list(p.device_mesh.shape), str(p.placements)] if isinstance(p, DTensor) else None
            for p in _flat_params(optimizer)]


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def save_optimizer(optimizer, model, path: Path) -> Path:
    """This rank's whole optimizer state (FSDP2's shards as this rank holds them) into ``path``."""
    state = optimizer.state_dict()
    state["state"] = {i: {k: _local(v).detach().cpu().clone() if torch.is_tensor(v) else v for k, v in entry.items()}
                      for i, entry in state["state"].items()}
    world = rank_and_world()[1]
    return write_atomically({"format": 1, "world": world, "experts": expert_layout(model),
                             "shards": _shards(optimizer), "state": state}, path)


def read_rank_file(path: Path, model, what: str) -> dict:
    """This rank's file, written by :func:`write_atomically` with ``experts``: refused when it is missing
    or was written by a rank holding other experts."""
    if not path.is_file():
        found = sorted(p.name for p in path.parent.glob("*.pt"))
        raise ExpertParallelError(
            f"{what}: {path.parent} has no {path.name} (this rank's optimizer state; found {found or 'none'}). Resume "
            "at the world size and plan (ep_size, placement) that wrote it, from a checkpoint written by a Trainer or "
            "Accelerator prepared by hp-rewrite (a save_only_model checkpoint starts the optimizer afresh)"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved["experts"] != expert_layout(model):
        raise ExpertParallelError(
            f"{what}: this rank held other experts when {path.parent} was written; resume with the plan (ep_size, "
            "placement) and world size of the run that wrote it"
        )
    return saved


def load_optimizer(optimizer, model, path: Path, what: str) -> None:
    """Put back what :func:`save_optimizer` wrote for this rank (same world, experts and shards)."""
    saved = read_rank_file(path, model, what)
    if saved.get("shards", _shards(optimizer)) != _shards(optimizer):
        raise ExpertParallelError(
            f"{what}: the parameters were sharded otherwise when {path.parent} was written (another FSDP2 mesh, or "
            "none); resume with the engine settings (FSDP2 or not, its mesh) of the run that wrote it"
        )
    state = saved["state"]
    params = _flat_params(optimizer)
    for i, entry in state["state"].items():
        p = params[int(i)]
        if isinstance(p, DTensor):  # this rank's shard, as FSDP2 holds it
            entry.update({k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride())
                          for k, v in entry.items() if torch.is_tensor(v) and v.shape == p.to_local().shape})
    optimizer.load_state_dict(state)
