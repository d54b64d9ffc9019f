"""A model's weights streamed as its checkpoint names them: what an RL trainer hands to vLLM or SGLang.

:func:`checkpoint_weights` yields ``(name, tensor)`` pairs with the names, layouts and values that
:func:`~hp_rewrite.loading.save.save_pretrained` writes for the unmodified model (the Hub's per-expert
keys where the checkpoint format has them, fused tensors where it is fused), so an inference engine's
own loader (``load_weights``) takes them as it takes the Hub's files. It is collective: every rank
iterates it to the end. Expert tensors travel in buckets of at most the plan's
``runtime.weight_sync_bucket_mb`` per receiving rank (a few experts of every EP rank at a time), never a layer's fused experts at once
where the format is per-expert; dense tensors are gathered (FSDP2 / TP shards) one decoder layer at a
time, as ``save_pretrained`` gathers them.

A PEFT model yields its merged weights under the base model's names, computed beside the base
weights (one tensor at a time), so the adapters stay unmerged and the base bit-identical afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..hf import original_format
from ..runtime import installed
from ..runtime.compute.quantized import QuantizedWeight
from ..runtime.errors import ExpertParallelError
from .record import record_of
from .save import _full, _is_distributed, _units, state_dict_name

__all__ = ["checkpoint_weights"]


def checkpoint_weights(model: nn.Module, *, dst: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every weight of ``model`` as ``save_pretrained`` would write it: the
    checkpoint format's names and layouts, full tensors in the model's dtype, on the model's device.

    Collective: call it on every rank and exhaust it on every rank (the ranks gather as they iterate).
    ``dst=None``: every rank receives every tensor (an inference engine colocated on each rank);
    ``dst=r``: only global rank ``r`` does (a server fed by one rank), the others yield nothing.
    The plan's ``runtime.weight_sync_bucket_mb`` (512 MiB unless set) bounds one gather of expert rows
    at the receiver.
    A ``PeftModel`` (or a model with PEFT's tuner layers) yields the merged weights under the base
    names; its adapters are neither merged nor changed. Experts kept quantised yield decoded, as
    ``save_pretrained`` writes them.
    """
    world, rank = (dist.get_world_size(), dist.get_rank()) if _is_distributed() else (1, 0)
    if dst is not None and not (isinstance(dst, int) and 0 <= dst < world):
        raise ExpertParallelError(f"checkpoint_weights: dst={dst!r} is not a rank of this {world}-rank world; "
                                  "pass a global rank, or dst=None for every rank")
    while isinstance(model, DistributedDataParallel) or isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod  # DDP, compile
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    limit = _bucket_bytes(base)
    merged = _MergedValues(base)
    receives = dst is None or rank == dst
    for unit in _units(base, sort=True):
        dense: dict[str, torch.Tensor] = {}
        for name, t, expert in unit:
            if merged.is_adapter(name):
                continue
            if t is None:
                yield from _module_experts(base, name, expert[0], dst, receives, limit)
            elif expert is None:
                if receives or hasattr(t, "full_tensor"):  # FSDP2 / TP shards: gathered by every rank
                    value = merged.value(t)
                    if receives:
                        dense[_base_name(name)] = value
            else:
                yield from _expert_tensor(base, _base_name(name), expert[0], expert[1], merged.value(t), dst,
                                          receives, limit)
        if dense:
            yield from original_format(base, dense).items()
        del dense


def _bucket_bytes(model: nn.Module) -> int:
    """The plan's ``runtime.weight_sync_bucket_mb`` in bytes (its default for a model not rewritten)."""
    from ..plan import RuntimeSection

    info = record_of(model)
    runtime = info.plan.runtime if info is not None else RuntimeSection()
    return max(1, int(runtime.weight_sync_bucket_mb * 2**20))


def _base_name(name: str) -> str:
    """A state-dict name without PEFT's wrappers (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


class _MergedValues:
    """Full values of a model's tensors with the active LoRA adapters added out of place, as PEFT's
    ``merge`` adds them in place (``weight += get_delta_weight(adapter)``, per adapter, in the weight's
    dtype), so that nothing of the model changes."""

    def __init__(self, model: nn.Module) -> None:
        self.deltas: dict[int, list[tuple[nn.Module, str]]] = {}
        adapters: set[int] = set()
        for path, module in model.named_modules():
            if hasattr(module, "original_module") and hasattr(module, "modules_to_save"):
                raise ExpertParallelError(
                    f"checkpoint_weights: {path} is a PEFT modules_to_save copy; merge the adapter first "
                    "(merged = peft_model.merge_and_unload()) and stream the merged model")
            names = getattr(module, "adapter_layer_names", None)
            if names is None:
                continue
            for attr in names:
                adapters.update(id(p) for p in getattr(module, attr).parameters())
            self._add(path, module)
        # by name: the state dict holds expert adapters gathered (loading.adapters), not the parameters
        self.adapters = {state_dict_name(n) for n, p in model.named_parameters(remove_duplicate=False)
                         if id(p) in adapters}

    def _add(self, path: str, layer: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer  # installed: its tuner layers are in the model

        if getattr(layer, "disable_adapters", False):
            return
        active = [a for a in layer.active_adapters if a not in layer.merged_adapters and
                  any(a in getattr(layer, attr, {}) for attr in layer.adapter_layer_names)]
        if not active:
            return
        variants = {**getattr(layer, "lora_variant", {}), **{a: 1 for a, on in getattr(layer, "use_dora", {}).items() if on}}
        if not isinstance(layer, LoraLayer) or not hasattr(layer, "get_delta_weight") or \
                any(a in variants for a in active):
            raise ExpertParallelError(
                f"checkpoint_weights: {path} ({type(layer).__name__}) is not a plain LoRA layer whose delta "
                "adds to its weight (DoRA and other variants, other tuners); merge it first "
                "(merged = peft_model.merge_and_unload()) and stream the merged model")
        base = layer.get_base_layer()
        param = getattr(base, getattr(layer, "parameter_name", "weight"))
        self.deltas.setdefault(id(param), []).extend((layer, a) for a in active)

    def is_adapter(self, name: str) -> bool:
        return name in self.adapters

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` gathered whole (FSDP2 / TP shards; experts kept quantised decoded), adapters added."""
        value = t.detach()
        value = value.dense() if isinstance(value, QuantizedWeight) else _full(value)
        layers = self.deltas.get(id(t), [])
        if layers:
            value = value.clone()
            with torch.no_grad():
                for layer, adapter in layers:
                    value += _full(layer.get_delta_weight(adapter))  # as PEFT's merge adds it: in place
        return value


def _ranks(binding) -> list[int]:
    """The global ranks of a holder's EP group, in group order."""
    return dist.get_process_group_ranks(binding.ep.group) if binding.ep.size > 1 else \
        [dist.get_rank() if _is_distributed() else 0]


def _exchange(piece: torch.Tensor, binding, dst: int | None, into: torch.Tensor | None = None):
    """Every EP rank's ``piece`` (the same shape on each), in EP-rank order, as views of one tensor
    (``into`` when given: the tensor being assembled) at the receivers; None elsewhere. All-gathered
    into that one tensor, so that no collective stages a flat copy of the list."""
    ep, rows = binding.ep, piece.shape[0]
    receives = dst is None or ep.size == 1 or dist.get_rank() == dst
    out = (into if into is not None else piece.new_empty((ep.size * rows, *piece.shape[1:]))) if receives else None
    if ep.size == 1:
        out.copy_(piece)
    elif dst is None:
        dist.all_gather_into_tensor(out, piece, group=ep.group)
    else:
        dist.gather(piece, list(out.split(rows)) if receives else None, dst=dst, group=ep.group)
    return list(out.split(rows)) if receives else None


def _delivers(binding, dst: int | None) -> bool:
    """Whether this rank's EP group sends its experts: each group holds every expert, so with a
    ``dst`` only the group holding ``dst`` sends (one copy), without one every group does."""
    return dst is None or dst in _ranks(binding)


def _expert_position(model: nn.Module, name: str, row: torch.Tensor) -> int | None:
    """Where a per-expert checkpoint format puts the expert index in the names it splits ``name``
    (the dot-separated part), or None where the format keeps the experts fused: reverted on empty
    (meta) stacks of one and two experts."""
    try:
        one = original_format(model, {name: torch.empty((1, *row.shape), dtype=row.dtype, device="meta")})
        two = original_format(model, {name: torch.empty((2, *row.shape), dtype=row.dtype, device="meta")})
    except Exception:  # noqa: BLE001 (a conversion that needs real values: gathered whole instead)
        return None
    if len(two) != 2 * len(one):
        return None
    first = [k.split(".") for k in one]
    for pos in range(len(first[0])):
        if all(len(k) == len(first[0]) and k[pos] == "0" for k in first):
            expected = {".".join([*k[:pos], i, *k[pos + 1:]]) for k in first for i in ("0", "1")}
            if expected == set(two) and all(t.dim() == row.dim() for t in two.values()):
                return pos
    return None


def _renamed(key: str, pos: int, ids: list[int]) -> str:
    parts = key.split(".")
    parts[pos] = str(ids[int(parts[pos])])
    return ".".join(parts)


def _slots(holder, limit: int, row_bytes: int) -> int:
    """How many local experts each EP rank sends per bucket: the receiver holds that many of every rank,
    and the checkpoint format's copy of one rank's part while converting it (splitting ``gate_up_proj``
    into ``gate_proj`` / ``up_proj`` copies), all of it within ``limit``."""
    ep = installed.binding(holder).ep
    return max(1, limit // max(1, row_bytes * (ep.size + 1)))


def _expert_tensor(model, name: str, holder, weight: str, local: torch.Tensor, dst, receives: bool,
                   limit: int) -> Iterator[tuple[str, torch.Tensor]]:
    """One fused expert weight ``[E_local, ...]`` of this rank: per-expert names bucket by bucket, or the
    full tensor where the format is fused (or flat, or has zero-expert rows every rank keeps)."""
    binding, layout = installed.binding(holder), installed.layout(holder)
    if not _delivers(binding, dst):
        return
    placement = binding.placement
    tail = None  # the zero experts' rows after the local ones: the same on every rank
    if weight in layout.padded_names:
        local, tail = local[: placement.num_local], local[placement.num_local:]
    rows = layout.per_expert(local)
    pos = None if tail is not None or layout.flat else _expert_position(model, name, rows[0])
    step = _slots(holder, limit, rows[0].numel() * rows.element_size())
    if pos is None:  # the whole tensor, gathered straight into its rows where the placement is contiguous
        full = rows.new_empty((placement.num_experts, *rows.shape[1:])) if receives else None
        into = full if receives and placement.is_contiguous else None
        parts = _exchange(rows.contiguous(), binding, dst, into)
        if not receives:
            return
        if into is None:
            for r, part in enumerate(parts):
                full[list(placement.experts_of(r))] = part
        del parts, into
        full = layout.stored(full if tail is None else torch.cat([full, tail]))
        yield from original_format(model, {name: full}).items()
        return
    for j in range(0, placement.num_local, step):  # a few experts of every rank per bucket, part by part
        parts = _exchange(rows[j: j + step].contiguous(), binding, dst)
        for r in range(len(parts) if receives else 0):
            ids = placement.experts_of(r)[j: j + step]
            converted = original_format(model, {name: parts[r]})  # may copy the part (split gate / up)
            for key in list(converted):  # popped: nothing here keeps a tensor once the consumer drops it
                yield _renamed(key, pos, ids), converted.pop(key)
        del parts


def _module_experts(model, path: str, holder, dst, receives: bool, limit: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Experts held as modules: each expert's tensors under its own names, a few experts per bucket."""
    binding, layout = installed.binding(holder), installed.layout(holder)
    local = {role: torch.stack([_full(layout.param(holder, f"{k}.{role}").detach()) for k in layout.held])
             for role in layout.roles}  # gathered on every rank: FSDP2's shards are collective
    if not _delivers(binding, dst):
        return
    placement, prefix = binding.placement, f"{path}." if path else ""
    row_bytes = sum(t[0].numel() * t.element_size() for t in local.values())
    step = _slots(holder, limit, row_bytes)
    for j in range(0, placement.num_local, step):
        parts = {role: _exchange(t[j: j + step].contiguous(), binding, dst) for role, t in local.items()}
        if not receives:
            continue
        tensors = {f"{prefix}{layout.expert_keys[e]}.{role}": row for role, got in parts.items()
                   for r, part in enumerate(got) for e, row in zip(placement.experts_of(r)[j: j + step], part,
                                                                    strict=True)}
        yield from original_format(model, tensors).items()
