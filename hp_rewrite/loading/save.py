"""Save an expert-parallel model back as a standard transformers checkpoint.

One decoder layer at a time is gathered to global rank 0 (its tensors over FSDP2's mesh when the
model is sharded, its experts over the EP group) and written to its own safetensors shard before
the next one, so rank 0 never holds more than one layer in full. The names are the model's in-memory names
(fused ``gate_up_proj`` / ``down_proj``), which unmodified transformers loads directly; an index
file maps names to shards. Everything is written into a temporary directory first and moved into
place (see :func:`_publish`), so an interrupted save leaves no half-written checkpoint, and saving
into an existing directory keeps the files that are not weights.
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

from ..runtime import ExpertParallelError, local_rows
from ..runtime.gradients import rank_local_modules

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


_WEIGHT_FILES = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def _publish(tmp: Path, out: Path) -> None:
    """Move the files written in ``tmp`` into ``out``. A new directory appears whole (one rename); an
    existing one (a Trainer run directory, a checkpoint folder...) keeps its other files, loses only
    the weight files of an earlier save, and gets the index last, so a reader never finds an index
    that names missing shards."""
    if not out.exists():
        os.replace(tmp, out)
        return
    new = {f.name for f in tmp.iterdir()}
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == INDEX_FILE):  # shards, then the index naming them
        os.replace(f, out / f.name)
    tmp.rmdir()
    for pattern in _WEIGHT_FILES:  # an earlier save's shards, no longer named by any index
        for stale in out.glob(pattern):
            if stale.name not in new:
                stale.unlink()


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2-sharded) gathered over its mesh (collective), a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _units(model: nn.Module) -> list[tuple[list[tuple[str, torch.Tensor]], list[tuple[str, nn.Module]]]]:
    """The state dict cut into what is gathered and written together: one unit per decoder layer
    (its own tensors and its experts holders), then everything outside the layers. Tied tensors
    appear once. The same order on every rank: gathering is collective."""
    holders = _holders(model)
    expert_names = {f"{path}.{w}" for path, m in holders for w in m.hp_layout.weight_names}
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [n for n, m in model.named_modules() if n and type(m).__name__ in layer_classes]
    layers = [n for n in layers if not any(n.startswith(f"{o}.") for o in layers)]  # outermost only
    units: dict[str, tuple[list, list]] = {n: ([], []) for n in [*layers, ""]}

    def unit_of(name: str) -> str:
        return next((n for n in layers if name.startswith(f"{n}.")), "")

    seen = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if name in expert_names or id(t) in seen:
            continue  # experts come per holder; tied weights are written once
        seen.add(id(t))
        units[unit_of(name)][0].append((name, t))
    for path, holder in holders:
        units[unit_of(f"{path}.")][1].append((path, holder))
    return [u for u in units.values() if u[0] or u[1]]


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write ``model`` (expert-parallel or not, FSDP2-sharded or not) as a checkpoint unmodified
    transformers can load.

    Collective: every rank must call it. One decoder layer at a time is gathered (its tensors over
    FSDP2's mesh, its experts over the EP group) and written by global rank 0 into its own shard,
    so rank 0 never holds more than one layer in full.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    out = Path(out_dir)
    units = _units(model)
    tmp = None
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for i, (tensors, holders) in enumerate(units):
            shard = f"model-{i + 1:05d}-of-{len(units):05d}.safetensors"
            written = {}
            for name, t in tensors:
                value = _full(t.detach())
                if rank == 0:
                    written[name] = value.contiguous().clone()
            for path, holder in holders:
                binding, layout = holder.hp_expert_parallel, holder.hp_layout
                for w in layout.weight_names:
                    local = _full(layout.param(holder, w).detach())  # this EP rank's experts, whole
                    if binding.ep.replica_rank != 0:
                        continue  # the first replica's EP group holds every expert once
                    tail = None  # the zero experts' rows after the local ones: the same on every rank
                    if w in layout.padded_names:
                        local, tail = local[: binding.placement.num_local], local[binding.placement.num_local :]
                    full = _gather_full(layout.per_expert(local), binding)
                    if rank == 0:  # flat layouts: back to the stored [E*R, C]
                        written[f"{path}.{w}"] = layout.stored(full if tail is None else torch.cat([full, tail]))
            if rank == 0:
                save_file(written, tmp / shard, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(written, shard))
                total += sum(t.numel() * t.element_size() for t in written.values())
            del written
        if rank == 0:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
            model.config.save_pretrained(tmp)
            generation = getattr(model, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(tmp)
            _publish(tmp, out)
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if distributed:
            dist.barrier()
    return out


def load_full_checkpoints(model: nn.Module) -> None:
    """Let ``load_state_dict`` take a full checkpoint's experts: each rank keeps its own rows.

    What :func:`save_pretrained` writes (and unmodified transformers writes) holds every expert; the
    expert-parallel model holds this rank's. Loaders that call ``load_state_dict`` on the model or on a
    wrapper of it (Trainer's ``resume_from_checkpoint``, PEFT, user code) then work unchanged; a tensor
    of neither the local nor the full shape is left for ``load_state_dict`` to reject.
    """

    def slice_experts(module, state_dict, prefix, *_):
        for path, holder in _holders(module):
            placement, layout = holder.hp_expert_parallel.placement, holder.hp_layout
            for w in layout.weight_names:
                key = f"{prefix}{path}.{w}"
                t, local = state_dict.get(key), layout.param(holder, w)
                if t is None or t.shape == local.shape:
                    continue
                experts = placement.num_experts + (layout.zero_experts if w in layout.padded_names else 0)
                if tuple(t.shape) == (experts * (layout.flat or 1), *local.shape[1:]):  # the full tensor
                    state_dict[key] = local_rows(holder, w, t)

    model.register_load_state_dict_pre_hook(slice_experts)


def refuse_partial_adapter_state(model: nn.Module) -> None:
    """A state dict of an expert-parallel model with PEFT adapters on its experts is an error.

    Each rank trains the adapters of its own experts, so one rank's state dict holds a fraction of
    them under the full model's names: PEFT's ``save_pretrained`` (from rank 0, as Trainer calls it)
    would write them as if they were all. Merging the adapters and saving with
    :func:`save_pretrained` from every rank writes the whole model.
    """

    def check(module, state_dict, prefix, local_metadata):
        holders = _holders(module)
        if not holders or all(h.hp_expert_parallel.ep.size == 1 for _, h in holders):
            return
        weights = {id(h.hp_layout.param(h, w)) for _, h in holders for w in h.hp_layout.weight_names}
        adapters = [f"{path}.{n}" if path else n for path, m in rank_local_modules(module)
                    for n, p in m.named_parameters() if id(p) not in weights]
        adapters = [n for n in adapters if f"{prefix}{n}" in state_dict]
        if adapters:
            raise ExpertParallelError(
                f"state_dict of an expert-parallel model with adapters on its experts ({adapters[0]}, ...): each "
                "rank holds only its own experts' adapters, so this would save (or restore) a fraction of them. "
                "Merge them (peft_model.merge_and_unload()) and save with hp_rewrite.save_pretrained(model, dir) "
                "on every rank"
            )

    model.register_state_dict_post_hook(check)
