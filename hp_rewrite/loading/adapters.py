"""PEFT adapters on the experts, in state dicts as plain PEFT has them.

PEFT puts LoRA on a 3-D expert weight ``[E, out, in]`` with a ``ParamWrapper`` (``target_parameters``):
``lora_A`` is ``[r*E, in]`` (rows expert-major: expert e's ``r`` rows together) and ``lora_B`` is
``[out, r*E]`` (columns rank-major, expert innermost). On an expert-parallel rank the wrapper sees
the local weight, so its adapters cover only this rank's experts. The model's ``state_dict()`` then
holds them gathered over the EP group, at the unmodified model's full shapes (what PEFT saves), and
``load_state_dict`` takes the full tensors (or this rank's own) and keeps this rank's part: PEFT's
``save_pretrained``, ``from_pretrained``, ``load_adapter`` and Trainer's checkpoints read and write
plain PEFT's files.

Taking such a state dict is collective over the EP group, like a full state dict of FSDP: every rank
calls it (``peft_model.save_pretrained(dir, is_main_process=rank == 0)`` on every rank). PEFT's loads
(``from_pretrained``, ``load_adapter``) take one too, so they run on every rank as well, as the
model's forward does. The gathered tensors are host (CPU) tensors, gathered one at a time, so a save
never holds more than one gathered adapter tensor on the accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..runtime import installed
from ..runtime.compute.experts import holder_of, wrapped
from ..runtime.errors import ExpertParallelError
from ..sync.gradients import rank_local_modules
from .record import record_of
from .save import state_dict_name


@dataclass(frozen=True)
class ExpertAdapter:
    """One LoRA factor on an expert weight: its state-dict key below the model, and where its experts are."""

    key: str
    holder: nn.Module
    weight: str  # the holder's expert weight the adapter is on (``gate_up_proj``)
    factor: str  # "A" ([r*E, in], experts along rows) or "B" ([out, r*E], experts innermost in columns)
    param: nn.Parameter

    def rows(self, experts) -> list[int]:
        """The full tensor's expert rows (global ids) of a rank holding ``experts``."""
        placement = installed.binding(self.holder).placement
        return list(installed.layout(self.holder).rows_of(self.weight, experts, placement.num_experts))

    @property
    def local_experts(self) -> int:
        """The expert rows of this rank's part (its experts, and the zero experts every rank keeps)."""
        return len(self.rows(installed.binding(self.holder).placement.local_experts))

    @property
    def full_experts(self) -> int:
        placement, layout = installed.binding(self.holder).placement, installed.layout(self.holder)
        return placement.num_experts + (layout.zero_experts if self.weight in layout.padded_names else 0)

    def per_expert(self, t: torch.Tensor, experts: int) -> torch.Tensor:
        """``t`` with the experts as their own dim: A ``[E, r, in]``, B ``[out, r, E]``."""
        return t.unflatten(0, (experts, -1)) if self.factor == "A" else t.unflatten(1, (-1, experts))

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.flatten(0, 1) if self.factor == "A" else t.flatten(1, 2)

    @property
    def expert_dim(self) -> int:
        """The experts' dim of :meth:`per_expert`."""
        return 0 if self.factor == "A" else 2

    def full_shape(self) -> list[int]:
        """The shape of the unmodified model's tensor."""
        shape = list(self.param.shape)
        dim = 0 if self.factor == "A" else 1
        shape[dim] = shape[dim] // self.local_experts * self.full_experts
        return shape


def _wrappers(module: nn.Module, path: str):
    """``(path, wrapper)`` of each PEFT wrapper between ``module`` and the experts holder it wraps."""
    holder = holder_of(module)
    while module is not holder:
        yield path, module
        attr, module = wrapped(module)
        path = f"{path}.{attr}" if path else attr


def expert_adapters(model: nn.Module) -> tuple[list[ExpertAdapter], list[str]]:
    """The LoRA factors on the model's expert-parallel experts, and the names of any other parameter
    that exists only on this rank besides the expert weights (an adapter whose layout is not known:
    refused by the hooks of :func:`install_adapter_state_hooks`)."""
    found, unknown = [], []
    for path, module in rank_local_modules(model):
        holder = holder_of(module)
        if holder is None or installed.binding(holder).ep.size == 1:
            continue  # a child holding a block's expert weights (JetMoE's): no adapter there; EP 1: all experts
        layout = installed.layout(holder)
        known = {id(layout.param(holder, w)) for w in layout.weight_names}
        for wpath, wrapper in _wrappers(module, state_dict_name(path)):
            name = getattr(wrapper, "parameter_name", None)
            if name is None or layout.modules or layout.flat or name not in layout.weight_names or \
                    layout.param(holder, name).dim() != 3:  # PEFT reads a 2-D one (a bias) as one expert
                continue
            for factor, factors in (("A", getattr(wrapper, "lora_A", {})), ("B", getattr(wrapper, "lora_B", {}))):
                for adapter, linear in factors.items():
                    found.append(ExpertAdapter(f"{wpath}.lora_{factor}.{adapter}.weight", holder, name, factor,
                                               linear.weight))
                    known.add(id(linear.weight))
        unknown += [state_dict_name(f"{path}.{n}" if path else n) for n, p in module.named_parameters()
                    if id(p) not in known]
    return found, unknown


def has_expert_adapters(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA factors on its expert-parallel experts (trainable or frozen): its
    state dicts then gather them, a collective every rank of the EP group must join."""
    return bool(expert_adapters(model)[0])


def _refuse(unknown: list[str], what: str) -> None:
    raise ExpertParallelError(
        f"{what} of an expert-parallel model with {unknown[0]} (and {len(unknown) - 1} more) on its experts: "
        "each rank holds only its own experts' part of it, and only LoRA on 3-D expert weights (PEFT "
        "target_parameters, e.g. 'mlp.experts.gate_up_proj') is gathered and sliced by expert; PEFT's "
        "modules_to_save and other adapters on the experts are not. Put them on non-expert modules, or "
        "merge the adapters (merge_and_unload) and save with hp_rewrite.save_pretrained(model, dir) on every rank"
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_full_adapter(adapter: ExpertAdapter, local: torch.Tensor) -> torch.Tensor:
    """The full-shape tensor of ``adapter`` (as the unmodified model's PEFT holds it), on the host,
    from every EP rank's part (collective over the EP group)."""
    binding = installed.binding(adapter.holder)
    ep, placement = binding.ep, binding.placement
    if local.is_meta:  # an adapter being created without storage (PEFT's low_cpu_mem_usage): only its shape
        return torch.empty(adapter.full_shape(), dtype=local.dtype, device="meta")
    local = _full(local).detach().contiguous()
    parts = [local]
    if ep.size > 1:
        parts = [torch.empty_like(local) for _ in range(ep.size)]
        dist.all_gather(parts, local, group=ep.group)
    full = local.new_zeros(adapter.full_shape(), device="cpu")
    per_expert = adapter.per_expert(full, adapter.full_experts)
    for rank in reversed(range(len(parts))):  # rows every rank keeps (zero experts): the lowest rank's
        rows = torch.tensor(adapter.rows(placement.experts_of(rank)))
        per_expert.index_copy_(adapter.expert_dim, rows, adapter.per_expert(parts[rank], adapter.local_experts).cpu())
    return full


def local_part(adapter: ExpertAdapter, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full-shape tensor of ``adapter``."""
    placement = installed.binding(adapter.holder).placement
    per = adapter.per_expert(full, adapter.full_experts)
    return adapter.flat(per.index_select(adapter.expert_dim,
                                         torch.tensor(adapter.rows(placement.local_experts), device=full.device)))


def _adapters_in(module: nn.Module, state_dict: dict, prefix: str, what: str) -> list[tuple[str, ExpertAdapter]]:
    """``(key, adapter)`` of the expert adapters ``state_dict`` holds; other rank-local tensors refused."""
    adapters, unknown = expert_adapters(module)
    unknown = [n for n in unknown if f"{prefix}{n}" in state_dict]
    if unknown:
        _refuse(unknown, what)
    return [(f"{prefix}{a.key}", a) for a in adapters if f"{prefix}{a.key}" in state_dict]


def adapter_tensors(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Parameter]]:
    """``(state-dict key, parameter)`` of every PEFT adapter tensor below ``module``: the
    ``adapter_layer_names`` of its tuner layers (LoRA's factors and the like)."""
    found = []
    for path, m in module.named_modules():
        for layer in getattr(m, "adapter_layer_names", ()):
            factors = getattr(m, layer, None)
            for name, p in factors.named_parameters() if isinstance(factors, nn.Module) else ():
                found.append((prefix + state_dict_name(f"{path}.{layer}.{name}" if path else f"{layer}.{name}"), p))
    return found


def _sharded_adapters(module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    """:func:`adapter_tensors` when FSDP2 (hp_rewrite.fully_shard, or an engine's through it) has
    sharded the model; empty otherwise."""
    if getattr(record_of(module), "fsdp", None) is None:
        return []
    return adapter_tensors(module, prefix)


def install_adapter_state_hooks(model: nn.Module) -> None:
    """State dicts of ``model`` (and of PEFT or engine wrappers around it) hold the expert adapters
    gathered at full shape; ``load_state_dict`` takes them full or local.

    Under FSDP2 every PEFT adapter tensor is whole in the state dict too (gathered to the host, one at
    a time), as plain PEFT's state dict holds it, and ``load_state_dict`` takes it whole: so PEFT's
    ``save_pretrained`` (on every rank) and ``load_adapter`` work on the sharded model as on any other.
    The frozen base weights stay FSDP2's DTensors."""

    def gather(module, state_dict, prefix, local_metadata):
        for key, adapter in _adapters_in(module, state_dict, prefix, "state_dict"):
            state_dict[key] = gather_full_adapter(adapter, state_dict[key])
        for key, _ in _sharded_adapters(module, prefix):
            if isinstance(state_dict.get(key), DTensor):
                state_dict[key] = state_dict[key].full_tensor().cpu()

    def slice_(module, state_dict, prefix, *_):
        for key, adapter in _adapters_in(module, state_dict, prefix, "load_state_dict"):
            t = state_dict[key]
            if torch.is_tensor(t) and t.shape != adapter.param.shape and list(t.shape) == adapter.full_shape():
                state_dict[key] = local_part(adapter, t)
        for key, param in _sharded_adapters(module, prefix):
            t = state_dict.get(key)
            if isinstance(param, DTensor) and torch.is_tensor(t) and not isinstance(t, DTensor) \
                    and t.shape == param.shape:  # whole: this rank's shard of it, no communication
                state_dict[key] = distribute_tensor(t.to(param.device), param.device_mesh, param.placements,
                                                    src_data_rank=None)

    model.register_state_dict_post_hook(gather)
    model.register_load_state_dict_pre_hook(slice_)
