"""Save an expert-parallel model back as a standard transformers checkpoint.

The files are those transformers' ``save_pretrained`` writes for the unmodified model (one
``model.safetensors`` below ``max_shard_size``, else numbered shards and an index; the checkpoint
format's own tensor names by default; ``config.json`` with ``architectures`` and ``dtype``). One decoder
layer at a time is gathered to global rank 0 (its tensors over FSDP2's mesh when the model is sharded,
its experts over the EP group) and added to the shard being filled, so rank 0 holds at most one layer
in full and one shard. Everything is written into a temporary directory first and moved into
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

from ..hf import original_format, save_remote_code, size_in_bytes, storage_key, transformers_logger
from ..runtime import installed
from ..runtime.binding.install import local_rows
from ..runtime.errors import ExpertParallelError
from ..sync.gradients import has_tuner_layers
from .checkpoint_files import expert_slices, foreign_experts, natural_key

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


#: the child that activation checkpointing's wrapper (torch's CheckpointWrapper) puts the layer under
CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."


def state_dict_name(path: str) -> str:
    """A module path as state dicts name it: the wrapper of activation checkpointing (accelerate's and
    Trainer's FSDP ``activation_checkpointing``) left out, as its own state dict hooks leave it out."""
    return path.replace(CHECKPOINT_WRAPPER, "")


def _holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(state_dict_name(n), m) for n, m in model.named_modules()
            if installed.binding(m) is not None]


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


#: one tensor of a unit: (name, tensor, experts holder and weight name for an expert weight, else None);
#: experts held as modules: (the holder's path, None, (holder, None)), all its experts' tensors at once
Entry = tuple[str, torch.Tensor | None, tuple[nn.Module, str | None] | None]


def _units(model: nn.Module, sort: bool) -> list[list[Entry]]:
    """The state dict cut into what is gathered and written together: one unit per decoder layer, one
    per tensor outside the layers, in the order transformers writes them (the state dict's; sorted by
    name, ``sort``, as its reverting to the checkpoint format sorts them). Tied tensors appear once, under
    the first name. The same order on every rank: gathering is collective."""
    holders = _holders(model)
    experts = {f"{path}.{w}": (m, w) for path, m in holders if not installed.layout(m).modules
               for w in installed.layout(m).weight_names}
    # experts held as modules: each rank holds other names; one entry for all of them, where the first is
    module_experts = {f"{path}.{w}": path for path, m in holders if installed.layout(m).modules
                      for w in installed.layout(m).weight_names}
    by_path = dict(holders)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [n for n, m in model.named_modules() if n and type(m).__name__ in layer_classes]
    layers = [n for n in layers if not any(n.startswith(f"{o}.") for o in layers)]  # outermost only
    units: dict[str, list[Entry]] = {}
    seen = set()
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or [])  # as save_pretrained drops them
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or name in ignored:
            continue
        seen.add(id(t))
        layer = next((n for n in layers if name.startswith(f"{n}.")), name)
        if name in module_experts:
            path = module_experts[name]
            if not any(e[0] == path for e in units.get(layer, [])):
                units.setdefault(layer, []).append((path, None, (by_path[path], None)))
            continue
        units.setdefault(layer, []).append((name, t, experts.get(name)))
    order = sorted(units, key=natural_key) if sort else list(units)
    return [units[k] for k in order]


def _gathered_modules(path: str, holder: nn.Module) -> dict[str, torch.Tensor]:
    """Every expert's tensors of a holder of expert modules, under their names (``path.{key}.w1.weight``,
    expert by expert, as the unmodified model's state dict orders them) on global rank 0; empty elsewhere.
    One gather per weight role over the EP group (after FSDP2's over its mesh)."""
    binding, layout = installed.binding(holder), installed.layout(holder)
    full = {}
    for role in layout.roles:
        local = torch.stack([_full(layout.param(holder, f"{k}.{role}").detach()) for k in layout.held])
        if binding.ep.replica_rank == 0:
            full[role] = _gather_full(local, binding)
    if not full or any(v is None for v in full.values()) or (_is_distributed() and dist.get_rank() != 0):
        return {}
    prefix = f"{path}." if path else ""
    return {f"{prefix}{k}.{role}": full[role][e].clone()  # own storage: safetensors refuses shared views
            for e, k in enumerate(layout.expert_keys) for role in layout.roles}


def _gathered(name: str, t: torch.Tensor, expert: tuple[nn.Module, str] | None) -> torch.Tensor | None:
    """The full tensor on global rank 0 (collective over FSDP2's mesh and the EP group); None elsewhere."""
    if expert is None:
        value = _full(t.detach())
        return value.contiguous().clone() if not _is_distributed() or dist.get_rank() == 0 else None
    holder, w = expert
    binding, layout = installed.binding(holder), installed.layout(holder)
    local = _full(layout.param(holder, w).detach())  # this EP rank's experts, whole
    if binding.ep.replica_rank != 0:
        return None  # the first replica's EP group holds every expert once
    tail = None  # the zero experts' rows after the local ones: the same on every rank
    if w in layout.padded_names:
        local, tail = local[: binding.placement.num_local], local[binding.placement.num_local :]
    full = _gather_full(layout.per_expert(local), binding)
    if full is None or (_is_distributed() and dist.get_rank() != 0):
        return None
    return layout.stored(full if tail is None else torch.cat([full, tail]))  # flat layouts: the stored [E*R, C]


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_file_on_rank0(path: Path, model: nn.Module, distributed: bool) -> bool:
    """Whether ``path`` is a file where global rank 0 (the writer) sees it: every rank takes its answer,
    so that all of them skip the collective save, or none. The flag travels on the device of the model's
    tensors, as the gathers that follow do (NCCL takes no CPU tensor)."""
    answer = path.is_file()
    if not distributed:
        return answer
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    flag = torch.tensor([answer], dtype=torch.uint8).to(device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


class _ShardWriter:
    """Tensors cut into shards exactly as ``save_pretrained`` cuts a state dict (huggingface_hub's
    split: in order, a new shard when the next tensor would pass ``max_bytes``, a larger tensor alone,
    views of one storage counted once and kept with the first), written unit by unit; named at the end:
    one ``model.safetensors``, or numbered shards and an index."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.shards: list[dict[str, torch.Tensor] | list[str]] = []  # open (tensors) or written (names)
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """One unit's tensors; every shard but the one being filled is written afterwards."""
        first_of: dict[object, dict[str, torch.Tensor]] = {}  # storage -> the shard of its first tensor
        for name, t in tensors.items():
            storage, size = storage_key(t)
            if storage is not None and storage in first_of:
                first_of[storage][name] = t
                continue
            self.total_bytes += size
            if size > self.max_bytes:
                shard = {name: t}
                self.shards.append(shard)
            else:
                if self.current_bytes + size > self.max_bytes:
                    self.shards.append(self.current)
                    self.current, self.current_bytes = {}, 0
                self.current[name] = t
                self.current_bytes += size
                shard = self.current
            if storage is not None:
                first_of[storage] = shard
        for i, shard in enumerate(self.shards):
            if isinstance(shard, dict):
                self._write(i, shard)

    def _write(self, i: int, shard: dict[str, torch.Tensor]) -> None:
        save_file({k: t.contiguous() for k, t in shard.items()}, self.directory / f".shard-{i}",
                  metadata={"format": "pt"})
        self.shards[i] = list(shard)

    def finish(self, total_parameters: int) -> None:
        if self.current:
            self.shards.append(self.current)
            self._write(len(self.shards) - 1, self.current)
        if len(self.shards) <= 1:
            if self.shards:
                os.replace(self.directory / ".shard-0", self.directory / SINGLE_FILE)
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            shard = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(self.directory / f".shard-{i}", self.directory / shard)
            weight_map.update(dict.fromkeys(names, shard))
        index = {"metadata": {"total_parameters": total_parameters, "total_size": self.total_bytes},
                 "weight_map": weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _total_parameters(model: nn.Module) -> int:
    """``num_parameters()`` of the unmodified model: every expert counted, tied weights once."""
    slices = expert_slices(model)
    total, seen = 0, set()
    for _, h in _holders(model):  # experts held as modules: every expert as this rank's first one
        if installed.layout(h).modules:
            seen.update(id(installed.layout(h).param(h, w)) for w in installed.layout(h).weight_names)
            total += len(installed.layout(h).expert_keys) * sum(
                installed.layout(h).param(h, f"{installed.layout(h).held[0]}.{r}").numel() for r in installed.layout(h).roles)
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        sl = slices.get(name)
        total += p.numel() if sl is None else p.numel() // sl.local_dim0 * sl.full_dim0
    return total


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike, max_shard_size: int | str = "50GB",
                    save_original_format: bool = True) -> None:
    """Write ``model`` (expert-parallel or not, FSDP2-sharded or not) as transformers' ``save_pretrained``
    writes the unmodified model: ``model.safetensors`` below ``max_shard_size`` (else numbered shards and
    an index), the names of the checkpoint format it was loaded from (``save_original_format``; else the
    in-memory names), ``config.json`` with ``architectures`` and ``dtype``, the generation config and a
    remote-code model's code files.

    Collective: every rank must call it. One decoder layer at a time is gathered (its tensors over
    FSDP2's mesh, its experts over the EP group) to global rank 0, which holds at most that layer and
    one shard being filled. Returns None, as transformers' does.
    """
    if has_tuner_layers(model):
        raise ExpertParallelError(
            "save_pretrained: the model carries PEFT adapters; a full checkpoint of it would hold PEFT's names "
            "(base_layer, lora_A), which plain transformers does not load. Save the adapter with "
            "peft_model.save_pretrained(dir) on every rank, or merge it first (merged = peft_model.merge_and_unload()) "
            "and save the merged model"
        )
    distributed = _is_distributed()
    rank = dist.get_rank() if distributed else 0
    out = Path(out_dir)
    if _is_file_on_rank0(out, model, distributed):  # as transformers: an error logged, nothing written or raised
        transformers_logger("modeling_utils").error(f"Provided path ({out_dir}) should be a directory, not a file")
        return None
    units = _units(model, sort=save_original_format)
    total_parameters = _total_parameters(model)
    tmp = writer = None
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        writer = _ShardWriter(tmp, size_in_bytes(max_shard_size))
    try:
        for unit in units:
            written = {}
            for name, t, expert in unit:
                if t is None:
                    written.update(_gathered_modules(name, expert[0]))
                else:
                    written[name] = _gathered(name, t, expert)
            if rank == 0:
                writer.add(original_format(model, written) if save_original_format else written)
            del written
        if rank == 0:
            writer.finish(total_parameters)
            _save_config(model, tmp)
            _publish(tmp, out)
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if distributed:
            dist.barrier()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unmodified model's state dict (in-memory names, every expert, on the CPU) on global rank 0,
    empty elsewhere: what accelerate's ``get_state_dict`` gives for a model that is whole on every rank.
    Collective, one decoder layer gathered at a time."""
    rank = dist.get_rank() if _is_distributed() else 0
    out: dict[str, torch.Tensor] = {}
    for unit in _units(model, sort=False):
        for name, t, expert in unit:
            got = _gathered_modules(name, expert[0]) if t is None else {name: _gathered(name, t, expert)}
            if rank == 0:
                out.update({k: v.cpu() for k, v in got.items()})
    return out


def _save_config(model: nn.Module, directory: Path) -> None:
    """``config.json`` (with ``dtype`` and ``architectures`` set, as ``save_pretrained`` sets them on the
    model's config), the generation config and a remote-code model's code files."""
    config = model.config
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    save_remote_code(model, directory)
    config.save_pretrained(directory)
    if getattr(model, "can_generate", lambda: False)() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def load_full_checkpoints(model: nn.Module) -> None:
    """Let ``load_state_dict`` take a full checkpoint's experts: each rank keeps its own rows.

    What :func:`save_pretrained` writes (and unmodified transformers writes) holds every expert; the
    expert-parallel model holds this rank's. Loaders that call ``load_state_dict`` on the model or on a
    wrapper of it (Trainer's ``resume_from_checkpoint``, PEFT, user code) then work unchanged; a tensor
    of neither the local nor the full shape is left for ``load_state_dict`` to reject.
    """

    def slice_experts(module, state_dict, prefix, *_):
        for name in foreign_experts(module):  # other ranks' expert modules: not this model's tensors
            state_dict.pop(f"{prefix}{name}", None)
        for path, holder in _holders(module):
            if installed.layout(holder).modules:
                continue
            placement, layout = installed.binding(holder).placement, installed.layout(holder)
            for w in layout.weight_names:
                key = f"{prefix}{path}.{w}"
                t, local = state_dict.get(key), layout.param(holder, w)
                if t is None or t.shape == local.shape:
                    continue
                experts = placement.num_experts + (layout.zero_experts if w in layout.padded_names else 0)
                if tuple(t.shape) == (experts * (layout.flat or 1), *local.shape[1:]):  # the full tensor
                    state_dict[key] = local_rows(holder, w, t)

    def shard_dense(module, state_dict, prefix, *_):
        """A TP-split (DTensor) parameter takes a full tensor as this rank's shard of it."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for name, t in module.named_parameters():
            key = f"{prefix}{state_dict_name(name)}"
            given = state_dict.get(key)
            if isinstance(t, DTensor) and torch.is_tensor(given) and not isinstance(given, DTensor) \
                    and given.shape == t.shape:
                state_dict[key] = distribute_tensor(given.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)

    model.register_load_state_dict_pre_hook(slice_experts)
    model.register_load_state_dict_pre_hook(shard_dense)
