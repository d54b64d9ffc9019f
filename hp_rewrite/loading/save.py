"""Save an expert-parallel model back as a standard transformers checkpoint.

Experts are gathered to global rank 0 one experts holder at a time, and each holder's full weights
go to their own safetensors shard before the next holder is gathered, so rank 0 never holds more
than the non-expert weights plus one layer's experts. The names are the model's in-memory names
(fused ``gate_up_proj`` / ``down_proj``), which unmodified transformers loads directly; an index
file maps names to shards. Everything is written into a temporary directory and renamed into
place, so an interrupted save leaves no half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

INDEX_FILE = "model.safetensors.index.json"


def _holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if getattr(m, "hp_expert_parallel", None) is not None]


def _gather_full(param: torch.Tensor, binding) -> torch.Tensor | None:
    """The full [E, ...] tensor on EP rank 0 of the first replica; None elsewhere."""
    ep = binding.ep
    local = param.detach().contiguous()
    if ep.size == 1:
        return local.clone()
    parts = [torch.empty_like(local) for _ in range(ep.size)] if ep.rank == 0 else None
    dist.gather(local, parts, group_dst=0, group=ep.group)
    if parts is None:
        return None
    placement = binding.placement
    if placement.is_contiguous:
        return torch.cat(parts)
    full = local.new_empty((placement.num_experts, *local.shape[1:]))
    for r, part in enumerate(parts):  # rank r's rows are its experts, ascending (the plan's placement)
        full[list(placement.experts_of(r))] = part
    return full


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write ``model`` (expert-parallel or not) as a checkpoint unmodified transformers can load.

    Collective: every rank must call it. Only global rank 0 writes.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    out = Path(out_dir)
    holders = _holders(model)
    expert_names = {f"{path}.{w}" for path, m in holders for w in m.hp_layout.weight_names}
    tmp = None
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        n_shards = 1 + len(holders)
        weight_map: dict[str, str] = {}
        total = 0

        def shard_name(i: int) -> str:
            return f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"

        if rank == 0:
            seen, tensors = set(), {}
            for name, t in model.state_dict().items():
                if name in expert_names or t.data_ptr() in seen:
                    continue  # experts come per holder below; tied weights are written once
                seen.add(t.data_ptr())
                tensors[name] = t.detach().contiguous().clone()
            save_file(tensors, tmp / shard_name(0), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, shard_name(0)))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        for i, (path, holder) in enumerate(holders, start=1):
            binding = holder.hp_expert_parallel
            if binding.ep.replica_rank != 0:
                continue  # the first replica's EP group holds every expert once
            full = {f"{path}.{w}": _gather_full(getattr(holder, w), binding) for w in holder.hp_layout.weight_names}
            if rank == 0:
                save_file(full, tmp / shard_name(i), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(full, shard_name(i)))
                total += sum(t.numel() * t.element_size() for t in full.values())
            del full
        if rank == 0:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
            model.config.save_pretrained(tmp)
            generation = getattr(model, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(tmp)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if distributed:
            dist.barrier()
    return out
