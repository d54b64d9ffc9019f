"""Load a checkpoint straight into :func:`hp_rewrite.fully_shard`'s shards: each rank reads from the
safetensors files only what it keeps.

The model is built on the meta device, the plan installed (this rank's experts), FSDP2 applied while
nothing has storage, and only then are the local shards allocated (``to_empty``). Every tensor is
then read into its shard:

* a dense tensor stored under its name, sharded on dim 0: only the shard's rows are read from the
  file's memory map, in chunks of at most 16 MiB;
* an expert weight that FSDP2 cuts on dim 0: its shard is whole experts, and only theirs are read
  (fused or per-expert keys alike, through :mod:`hp_rewrite.loading.local`'s paths);
* anything else (an expert weight cut on dim 1, a transformers converter): this rank's experts of
  that one tensor are read, the shard copied out, and the rest dropped before the next tensor.

So a rank's peak is its final shards plus, at most, one tensor's local experts, never the model;
buffers the checkpoint does not hold (rotary frequencies) and tensors it lacks are initialised by the
model as ``from_pretrained`` does, each rank keeping its shard of the unmodified model's draw
(:mod:`hp_rewrite.loading.initialise`: one parameter at its full size at a time), and reported in
transformers' LOAD REPORT.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..hf import loading_info, log_loading_report, quiet_transformers
from ..loading import local
from ..loading.patch import DEFAULT_ARTIFACT_DIR, attach, expert_parallel_group_for, resolve_plan
from ..loading.record import RewriteInfo, record_of
from ..runtime.errors import ExpertParallelError
from .fsdp import fully_shard


def _shard_box(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of ``t``."""
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)


def _copy_shard(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's part of the whole (EP-local) ``value`` into ``target`` (a shard or a tensor)."""
    if not isinstance(target, DTensor):
        target.copy_(value)
        return
    shape, offset = _shard_box(target)
    if any(shape):
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        target.to_local().copy_(value[box])


def _rows_only(target: torch.Tensor, info) -> bool:
    """A dense DTensor sharded on dim 0 only, stored whole under one key: read its rows directly."""
    if not isinstance(target, DTensor) or tuple(info.shape) != tuple(target.shape) or not info.shape:
        return False
    return all(not isinstance(p, Shard) or p.dim == 0 for p in target.placements)


def _read_shards_of_experts(filler, experts: dict, targets: dict) -> set[str]:
    """Narrow the reader to each rank's shard of an expert weight that FSDP2 cuts on dim 0: the shard
    is whole experts, so only theirs are read (no tensor of all local experts in between). Returns
    the names whose filled value is the shard itself."""
    whole = set()
    for name, sl in experts.items():
        t = targets[name]
        if not isinstance(t, DTensor) or any(isinstance(p, Shard) and p.dim != 0 for p in t.placements):
            continue
        shape, offset = _shard_box(t)
        if not shape[0]:
            continue  # an uneven cut left this rank no experts of it: nothing to read
        filler.experts[name] = type(sl)(sl.experts[offset[0] : offset[0] + shape[0]], sl.num_experts)
        filler.meta[name] = torch.empty(shape, dtype=filler.meta[name].dtype, device="meta")
        whole.add(name)
    allocate = filler.empty

    def empty(name: str) -> torch.Tensor:  # the shard itself: the reads land in place, no copy after
        if name in whole and filler.dtype_for(name) == targets[name].dtype:
            return targets[name].to_local()
        return allocate(name)

    filler.empty = empty
    return whole


def load_fully_sharded(model_dir: str | Path, plan=None, *, mesh: DeviceMesh | None = None,
                       dtype: torch.dtype | None = None, artifact_dir: Path | None = None,
                       chunk_bytes: int = local.CHUNK_BYTES, attn_implementation: str | None = None,
                       trust_remote_code: bool = False, **fsdp) -> nn.Module:
    """The checkpoint in ``model_dir`` as a rewritten model sharded by :func:`fully_shard` (its keyword
    arguments in ``fsdp``), each rank having read only its shards. Collective; returns ``eval()``.
    ``dtype`` and ``attn_implementation`` default to ``from_pretrained``'s: the checkpoint's dtype and
    transformers' attention choice; ``trust_remote_code`` as ``from_pretrained``'s."""
    plan = resolve_plan(plan)
    if plan.tp_size > 1:
        raise ExpertParallelError(
            f"load_fully_sharded with tp_size {plan.tp_size} is not supported: load with hp_rewrite.from_pretrained "
            "(each rank reads only its experts), then call hp_rewrite.fully_shard(model)"
        )
    ep = expert_parallel_group_for(plan, mesh)
    if ep.mesh is None:
        raise ExpertParallelError("load_fully_sharded needs torch.distributed initialised (launch with torchrun)")
    out = Path(artifact_dir or plan.output.dir or DEFAULT_ARTIFACT_DIR)
    loading = local.prepare(model_dir, plan, ep, out, dtype, chunk_bytes, attn_implementation, trust_remote_code,
                            strict=False)
    model = loading.model
    absent = sorted(n for f in loading.foreign[0].values() for n in f.to_draw)
    if absent:
        raise ExpertParallelError(
            f"load_fully_sharded: {absent[0]} (an expert module another rank holds) is not in the checkpoint: "
            "load with hp_rewrite.from_pretrained (it draws what the checkpoint lacks as transformers does), "
            "then call hp_rewrite.fully_shard")
    if getattr(model, "all_tied_weights_keys", None):
        raise ExpertParallelError(
            f"load_fully_sharded: {type(model).__name__} ties weights ({sorted(model.all_tied_weights_keys)[0]}, "
            "...); load it with hp_rewrite.from_pretrained, then call hp_rewrite.fully_shard"
        )
    attach(model, RewriteInfo(plan, ep, out, loading.patched))
    fully_shard(model, **fsdp)  # on the meta device: the shards' shapes, no storage yet
    device = torch.device(ep.mesh.device_type, torch.cuda.current_device()) if ep.mesh.device_type == "cuda" \
        else torch.device(ep.mesh.device_type)
    model.to_empty(device=device)  # only the local shards are allocated
    targets = model.state_dict(keep_vars=True)
    reader, filler = loading.reader, loading.filler
    filler.experts = dict(loading.experts)  # narrowed to the shards below; the load keeps its experts
    whole = _read_shards_of_experts(filler, loading.experts, targets)
    with torch.no_grad():
        for unit in loading.ordered_units():
            name = unit.targets[0]
            if unit.key is not None and name not in loading.experts and _rows_only(targets[name], reader.infos[unit.key]):
                filler.paths["tensor"] += 1
                shape, offset = _shard_box(targets[name])
                if shape[0]:
                    reader.copy_into(unit.key, targets[name].to_local(), offset[0], offset[0] + shape[0])
            else:
                for target, value in filler.fill(unit).items():
                    if target in whole:  # read as exactly this rank's shard, most often in place
                        local_shard = targets[target].to_local()
                        if value.data_ptr() != local_shard.data_ptr():
                            local_shard.copy_(value)
                    else:
                        _copy_shard(targets[target], value.to(targets[target].dtype))
            for target in unit.targets:
                targets[target]._is_hf_initialized = True  # transformers' init skips what was loaded
    missing = [n for n in targets if n not in {t for u in loading.units.values() for t in u.targets}]
    with quiet_transformers():
        for name in missing:  # drawn by the model's own init, as from_pretrained draws them (:mod:`.initialise`)
            targets[name]._is_hf_initialized = False
        if hasattr(model, "initialize_weights"):
            loading.initialise_missing()  # with non-persistent buffers (rotary inv_freq)
    info = loading_info(loading.allowed_missing, set(loading.unexpected.values()))
    model._adjust_missing_and_unexpected_keys(info)
    log_loading_report(model, model_dir, info)  # transformers' report of what the checkpoint lacks or adds
    model.eval()
    record_of(model).load_report = loading.report()
    return model
