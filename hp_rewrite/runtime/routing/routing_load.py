"""What the routers chose, counted on the device while the model trains, and reduced once a step.

Each MoE layer's experts holder carries an :class:`ExpertLoad` when the plan's ``routing:`` section
wants the counts (statistics, the correction-bias update). Every training forward adds the slots this
rank's tokens chose per expert (kept, and dropped for capacity) and the bytes its exchange sent: a
few ``[E]`` additions on the device, no host value. A forward without gradients (evaluation,
generation; reentrant activation checkpointing's forward excepted) is not counted, nor is activation
checkpointing's recomputation, which runs inside backward and would count the same tokens twice.

:class:`ModelRouting` (one per rewritten model) reduces every layer's counts over the world in one
all-reduce at each optimizer step (:meth:`ModelRouting.step`) and keeps the global counts until they
are read (:meth:`ModelRouting.read`, one host read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.tensor
from torch import nn

from .. import installed
from ..errors import ExpertParallelError
from .replay import inside_backward, inside_checkpoint


def counted_forward(training: bool) -> bool:
    """Whether the running forward is a training forward seen for the first time: with gradients (or,
    for a module in training mode, inside reentrant activation checkpointing's forward, which runs
    without them), and not the recomputation of activation checkpointing (inside backward's graph task).
    The stack is walked only for a training-mode forward without gradients, never in generation."""
    if torch.compiler.is_compiling():  # traced once; the compiler's own recomputation never reruns Python
        return torch.is_grad_enabled()
    if inside_backward():
        return False
    return torch.is_grad_enabled() or (training and inside_checkpoint())


class ExpertLoad:
    """One layer's routing counts since the last :meth:`take`: ``chosen [E]`` slots per expert (the
    router's choice, before any capacity drop), ``dropped [E]``, ``rank_rows [2, ep]`` the kept slots sent
    to each EP rank as placed and as computed (``runtime.balance`` moves some), the bytes its exchange
    sent and the tokens it routed (host values, not counted while compiled)."""

    def __init__(self, num_experts: int, ranks: int = 1) -> None:
        self.num_experts, self.ranks = num_experts, ranks
        self.chosen: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        self.rank_rows: torch.Tensor | None = None
        self.bytes_sent = self.tokens = 0
        self.owner: ModelRouting | None = None

    @property
    def width(self) -> int:
        """Values per layer in the reduced vector: chosen [E], dropped [E], rank rows [2 * ep], bytes, tokens."""
        return 2 * self.num_experts + 2 * self.ranks + 2

    def record(self, kept: torch.Tensor, dropped: torch.Tensor, bytes_sent: int, tokens: int,
               training: bool, rank_rows: torch.Tensor) -> None:
        if not counted_forward(training):
            return
        if self.owner is not None and self.owner.bias_update_rate and not self.owner.tracked:
            raise ExpertParallelError(
                "routing.bias_update_rate: nothing updates the routers' selection bias after the optimizer "
                "steps; call hp_rewrite.track_routing(model, optimizer) once before training (a Trainer prepared "
                "by hp_rewrite.prepare_trainer and an Accelerator by prepare_accelerator do it), or set "
                "routing.bias_update_rate: 0"
            )
        if self.chosen is None:
            self.chosen, self.dropped, self.rank_rows = kept + dropped, dropped.clone(), rank_rows.clone()
        else:
            self.chosen += kept + dropped
            self.dropped += dropped
            self.rank_rows += rank_rows
        if not torch.compiler.is_compiling():  # host ints here; traced sizes under compile
            self.bytes_sent += int(bytes_sent)
            self.tokens += int(tokens)

    def take(self, device: torch.device) -> torch.Tensor:
        """``[width]`` int64 on ``device``: chosen, dropped, rank rows, bytes, tokens; the counts start again
        from zero."""
        e = self.num_experts
        chosen = self.chosen if self.chosen is not None else torch.zeros(e, dtype=torch.int64, device=device)
        dropped = self.dropped if self.dropped is not None else torch.zeros(e, dtype=torch.int64, device=device)
        ranks = self.rank_rows if self.rank_rows is not None else torch.zeros(2, self.ranks, dtype=torch.int64,
                                                                              device=device)
        host = [torch.full((1,), v, dtype=torch.int64, device=device) for v in (self.bytes_sent, self.tokens)]
        self.chosen, self.dropped, self.rank_rows, self.bytes_sent, self.tokens = None, None, None, 0, 0
        return torch.cat([chosen.to(device), dropped.to(device), ranks.to(device).reshape(-1), *host])  # no upload


@dataclass(frozen=True, eq=False)
class RouterOf:
    """Where one MoE layer's router lives (set on its experts holder at install): the block, the
    block's child holding the router, and the owner (path below the block, ``""`` the block itself) and
    name of its selection bias. Looked up by name each time: moving the model replaces its tensors."""

    block: nn.Module
    router: str | None
    bias_owner: str | None = None
    bias_name: str | None = None
    chooses: bool = False  # the router module itself takes the top-k (the block calls it as a module)
    top_k: int | None = None  # experts per token, when the block or its config says

    def router_module(self) -> nn.Module | None:
        return None if self.router is None else self.block.get_submodule(self.router)

    def bias(self) -> torch.Tensor | None:
        if self.bias_name is None:
            return None
        owner = self.block.get_submodule(self.bias_owner) if self.bias_owner else self.block
        return getattr(owner, self.bias_name)


def update_selection_bias(bias: torch.Tensor, chosen: torch.Tensor, rate: float,
                          master: torch.Tensor | None = None) -> torch.Tensor | None:
    """DeepSeek-V3's auxiliary-loss-free balancing: ``bias += rate * sign(mean load - load)`` (an
    underloaded expert is chosen more often next step), outside autograd. A bias not in fp32 is updated
    through an fp32 ``master`` (returned; pass it back next step): in bf16 a step of 0.001 would round
    away on any bias above 0.5."""
    if isinstance(bias, torch.distributed.tensor.DTensor):
        raise ExpertParallelError(
            "routing.bias_update_rate: the selection bias is a parameter FSDP2 shards (Ernie 4.5, AfMoE...); "
            "its update is not supported there yet: set routing.bias_update_rate: 0, or train with DDP"
        )
    load = chosen.to(device=bias.device, dtype=torch.float32)
    step = torch.sign(load.mean() - load)
    with torch.no_grad():
        if bias.dtype == torch.float32:
            bias.view(-1).add_(step, alpha=rate)
            return None
        master = bias.detach().float().clone() if master is None else master
        master.view(-1).add_(step, alpha=rate)
        bias.copy_(master.view(bias.shape))
        return master


@dataclass(frozen=True)
class LayerCounts:
    """One layer's global counts over the steps read: its holder's module path and log index."""

    name: str
    index: int
    block: str  # the MoE block's path (placement loads and profiles are keyed by it)
    tokens_per_expert: tuple[int, ...]
    dropped_per_expert: tuple[int, ...]
    rank_rows: tuple[int, ...]  # kept slots per EP rank as placed (every EP group's summed)
    rank_rows_balanced: tuple[int, ...]  # the same where they were computed (runtime.balance)
    bytes_sent: int
    tokens: int


def layer_index(path: str, default: int | None = None) -> int | None:
    """The decoder layer number in a module path: its first numeric part, the index into the model's
    outermost layer list (``model.layers.7.mlp.experts`` -> 7; a vision-language model's
    ``model.language_model.layers.12.mlp`` -> 12; a block nested in a layer,
    ``model.layers.3.mlp.moe_layers.1`` -> 3, not 1), else ``default``."""
    return next((int(p) for p in path.split(".") if p.isdigit()), default)


class ModelRouting:
    """The routing counts of one rewritten model: per step, reduced over ``group`` (the world when
    None and torch.distributed is initialised); kept on the device until read."""

    def __init__(self, holders: list[tuple[str, nn.Module]], group: dist.ProcessGroup | None = None, *,
                 log: bool = True, bias_update_rate: float = 0.0) -> None:
        self.names = [name for name, _ in holders]
        self.blocks = [name if installed.router(h).block is h else name.rsplit(".", 1)[0] for name, h in holders]
        self.loads = [installed.routing_load(h) for _, h in holders]
        self.routers = [installed.router(h) for _, h in holders]
        self.replays = [installed.binding(h).routes for _, h in holders]
        self.masters: list[torch.Tensor | None] = [None] * len(holders)  # fp32 copies of biases not in fp32
        self.some_holder = holders[0][1] if holders else None
        self.log, self.bias_update_rate = log, bias_update_rate
        self.tracked = False  # something calls step() after every optimizer step (track_routing, the engines)
        for load in self.loads:
            load.owner = self
        indices = [layer_index(n, i) for i, n in enumerate(self.names)]
        self.indices = indices if len(set(indices)) == len(indices) else list(range(len(indices)))
        self.group = group
        self.window: torch.Tensor | None = None  # global counts since the last read
        self.this_step: torch.Tensor | None = None  # global counts since the last optimizer step
        self.steps = 0  # optimizer steps since the last read

    def _device(self) -> torch.device:
        """Where the counts live: those of a forward, else of the window, else of the experts' tensors (a
        rank that counted nothing this step reduces zeros where the others reduce their counts)."""
        found = next((load.chosen.device for load in self.loads if load.chosen is not None), None)
        found = found or next((t.device for t in (self.window, self.this_step) if t is not None), None)
        if found is None and self.some_holder is not None:
            found = next((t.device for t in (*self.some_holder.parameters(), *self.some_holder.buffers())
                          if t.device.type != "meta"), None)
        return found or torch.device("cpu")

    def reduce(self) -> None:
        """Reduce the counts of the forwards not reduced yet over the world (one all-reduce; every rank
        calls it) into the window and into the current step's counts."""
        if not self.loads:
            return
        device = self._device()
        flat = torch.cat([load.take(device) for load in self.loads])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, group=self.group)
        self.window = flat if self.window is None else self.window + flat
        self.this_step = flat if self.this_step is None else self.this_step + flat

    def step(self) -> list[torch.Tensor]:
        """After an optimizer step (every rank): reduce, and return each layer's global counts of that
        step (:meth:`ExpertLoad.take`'s layout); the next step starts from zero."""
        self.reduce()
        flat, self.this_step = self.this_step, None
        self.steps += 1
        for replay in self.replays:  # a checkpointed forward with no backward in the step: nothing to replay
            replay.pending.clear()
        if flat is None:
            return []
        layers = list(flat.split([load.width for load in self.loads]))
        if self.bias_update_rate:
            for i, (counts, load, router) in enumerate(zip(layers, self.loads, self.routers, strict=True)):
                self.masters[i] = update_selection_bias(router.bias(), counts[: load.num_experts],
                                                        self.bias_update_rate, self.masters[i])
        return layers

    def read(self) -> tuple[int, list[LayerCounts]]:
        """``(steps, per-layer counts)`` of the window, read to the host at once; the window empties."""
        steps, window = self.steps, self.window
        self.steps, self.window = 0, None
        if window is None:
            return 0, []
        values, out, start = window.tolist(), [], 0
        for name, index, block, load in zip(self.names, self.indices, self.blocks, self.loads, strict=True):
            e, r = load.num_experts, load.ranks
            part = values[start : start + load.width]
            out.append(LayerCounts(name, index, block, tuple(part[:e]), tuple(part[e : 2 * e]),
                                   tuple(part[2 * e : 2 * e + r]), tuple(part[2 * e + r : 2 * e + 2 * r]),
                                   *part[2 * e + 2 * r :]))
            start += load.width
        return steps, out


def _holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every experts holder of ``model``, each with its :class:`RouterOf` (installed by hand: none known)."""
    found = installed.holders(model)
    for _, m in found:
        if installed.router(m) is None:
            installed.state_of(m).router = RouterOf(m, None)
    return found


def install_routing_loads(model: nn.Module, group: dist.ProcessGroup | None = None, *, log: bool = True,
                          bias_update_rate: float = 0.0) -> ModelRouting:
    """Give every experts holder of ``model`` an :class:`ExpertLoad` and return the model's counts;
    with ``bias_update_rate`` every layer's router must have a selection bias of one weight per expert."""
    holders = _holders(model)
    for name, m in holders:
        binding, bias = installed.binding(m), installed.router(m).bias()
        if bias_update_rate and (bias is None or bias.numel() != binding.num_experts):
            what = "has no selection bias (e_score_correction_bias, expert_bias)" if bias is None else \
                f"has a selection bias of {bias.numel()} values for {binding.num_experts} routed experts"
            raise ExpertParallelError(
                f"routing.bias_update_rate: the router of {name.rsplit('.', 1)[0] or name} "
                f"({type(installed.router(m).block).__name__}) {what}; the update needs one bias per routed expert "
                "(DeepSeek-V3's routers and their kin): set routing.bias_update_rate: 0 for this model"
            )
        installed.state_of(m).load = ExpertLoad(binding.num_experts, binding.ep.size)
    return ModelRouting(holders, group, log=log, bias_update_rate=bias_update_rate)


def freeze_routers(model: nn.Module) -> None:
    """``routing.freeze_router``: every rewritten layer's router weights and biases (its selection bias
    too, when a parameter) stop requiring gradients, before any engine or optimizer sees them."""
    for name, m in _holders(model):
        router = installed.router(m).router_module()
        if router is None:
            raise ExpertParallelError(
                f"routing.freeze_router: no router module found in {name.rsplit('.', 1)[0] or name} "
                f"({type(installed.router(m).block).__name__}); freeze its router parameters yourself "
                "(requires_grad_(False)) and drop routing.freeze_router"
            )
        for p in router.parameters():
            p.requires_grad_(False)
        bias = installed.router(m).bias()
        if isinstance(bias, nn.Parameter):
            bias.requires_grad_(False)


def router_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter inside the rewritten layers' router modules (adapters put on them included),
    by its name in ``model``."""
    ids = {id(p) for _, m in _holders(model) if installed.router(m).router_module() is not None
           for p in installed.router(m).router_module().parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}
