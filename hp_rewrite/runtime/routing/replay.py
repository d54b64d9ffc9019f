"""Routing replay: a forward that uses experts chosen by another forward.

Two uses (plan ``routing.replay_in_recompute``, :func:`record_routing` / :func:`replay_routing`):

* activation checkpointing recomputes a layer's forward inside backward; in bf16 its router can round
  differently and choose other experts than the forward did, so the gradients belong to another
  model. A training forward inside a checkpointed region keeps its choice (``[T, K]`` indices, int16
  where the ids fit) and the recomputation replays it;
* reinforcement learning records the experts chosen while rolling out (here, or by the inference
  engine: :mod:`hp_rewrite.training.rollout`) and replays them in the training forward, as
  Megatron-Core's router replay does. A replayed row of ``-1`` (a padding position, a token the
  engine never forwarded) is routed by the router itself.

Replaying forces the top-k over the experts: while the block runs, the one ``torch.topk`` whose input
has one score per expert and whose ``k`` is the routing's returns the recorded experts, with the
scores gathered at them. The routing weights and the router's gradient are then those of the current
logits at the recorded experts, whatever the router does next (softmax, renormalisation, scaling).
A block whose router does not choose with ``torch.topk`` is refused when replayed.
"""

from __future__ import annotations

import sys
import warnings
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import installed
from ..errors import ExpertParallelError

_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


def inside_backward() -> bool:
    """Whether autograd's backward is running (activation checkpointing recomputes there)."""
    return torch._C._current_graph_task_id() != -1


def inside_checkpoint() -> bool:
    """Whether ``torch.utils.checkpoint`` is on the stack (its forward, reentrant or not)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False


class ForcedTopK(TorchFunctionMode):
    """While a block runs: its top-k over the experts (the first ``torch.topk`` over ``widths`` scores)
    returns ``indices`` (``None``: the experts the top-k itself chooses) as ``scores.gather(indices)``.

    Gathering also where nothing is forced keeps a checkpointed forward and its recomputation alike:
    autograd saves the same tensors for both (``torch.utils.checkpoint`` compares them)."""

    def __init__(self, indices: torch.Tensor | None, widths: tuple[int, ...], top_k: int | None,
                 keep: bool = False, tally: LayerRoutes | None = None) -> None:
        super().__init__()
        self.indices, self.widths, self.keep, self.tally = indices, widths, keep, tally
        self.top_k = indices.shape[-1] if indices is not None else top_k
        self.chosen: torch.Tensor | None = None

    def _routing(self, scores: torch.Tensor, k, dim) -> bool:
        """The routing's top-k: over one score per expert, ``k`` experts per token. A group's score over a
        single group (DeepSeek-style routers with ``n_group`` 1, ``[T, 1, E]``) is not it."""
        if self.chosen is not None or scores.shape[-1] not in self.widths or dim not in (-1, scores.dim() - 1):
            return False
        if k != self.top_k or (scores.dim() > 2 and scores.shape[-2] == 1):
            return False
        return self.indices is None or scores.shape[:-1].numel() == self.indices.shape[0]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            scores = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if self._routing(scores, k, dim):
                if self.indices is None:
                    with torch.no_grad():
                        forced = func(*args, **kwargs)[1]
                else:
                    forced = self.indices.to(scores.device, torch.int64).reshape(*scores.shape[:-1], k)
                    if self.tally is not None:  # a replay: the router's own choice fills the rows left -1
                        with torch.no_grad():
                            own = func(*args, **kwargs)[1]
                        self.tally.count(forced, own)
                        forced = torch.where(forced < 0, own, forced)
                self.chosen = forced
                return torch.return_types.topk((scores.gather(-1, forced), forced))
        return func(*args, **kwargs)


class LayerRoutes:
    """One MoE layer's replay state, on its binding: what its checkpointed forwards chose (for their
    recomputations), what a recording collects, what a replay hands out."""

    def __init__(self) -> None:
        self.widths: tuple[int, ...] = ()
        self.top_k: int | None = None
        self.in_recompute = False  # plan routing.replay_in_recompute, set when the model is rewritten
        self.pending: deque[torch.Tensor] = deque()  # checkpointed forwards waiting for their recomputation
        self.recording: list[torch.Tensor] | None = None
        self.replaying: deque[torch.Tensor] | None = None
        self.name = ""
        self.mode: ForcedTopK | None = None
        self.replayed: torch.Tensor | None = None  # replayed tokens, and those the router would have sent elsewhere
        self.disagreed: torch.Tensor | None = None

    def count(self, recorded: torch.Tensor, own: torch.Tensor) -> None:
        """Tally a replay on the device (no host sync): the recorded rows, and those whose experts differ
        from what the router chooses now (R3's router disagreement)."""
        kept = recorded[..., 0] >= 0
        differ = (recorded.sort(-1).values != own.sort(-1).values).any(-1) & kept
        replayed, disagreed = kept.sum(), differ.sum()
        if self.replayed is None:
            self.replayed, self.disagreed = replayed, disagreed
        else:
            self.replayed, self.disagreed = self.replayed + replayed, self.disagreed + disagreed

    def _stored(self, indices: torch.Tensor) -> torch.Tensor:
        small = torch.int16 if max(self.widths, default=0) <= torch.iinfo(torch.int16).max else torch.int32
        return indices.detach().reshape(-1, indices.shape[-1]).to(small)

    def note(self, indices: torch.Tensor) -> None:
        """The layer's dispatch got ``indices [T, K]``: kept when recording."""
        if self.recording is None:
            return
        if torch.compiler.is_compiling():
            raise ExpertParallelError("record_routing: a compiled forward cannot record its routing; record it "
                                      "with the model not compiled (torch.compile replays its own graph)")
        if not inside_backward():
            self.recording.append(self._stored(indices))

    def _forced(self, training: bool) -> tuple[torch.Tensor | None, bool, bool]:
        """``(indices to force, whether to force at all, whether to keep the choice for a recomputation)``."""
        if inside_backward():  # a recomputation: its forward's choice, if it kept one
            if not (torch.is_grad_enabled() and self.pending):
                return None, False, False
            if len(self.pending) > 1:
                waiting = len(self.pending)
                self.pending.clear()
                raise ExpertParallelError(
                    f"routing replay: {self.name} is recomputed while {waiting} of its checkpointed forwards wait "
                    "for backward, so which one's routing to replay is not known; run backward after each forward "
                    "before the next (a forward whose loss is not backpropagated: run it under torch.no_grad()), or "
                    "set routing.replay_in_recompute: false"
                )
            return self.pending.popleft(), True, False
        checkpointed = training and inside_checkpoint()  # transformers checkpoints training forwards only
        if self.replaying is not None:
            if not self.replaying:
                raise ExpertParallelError(f"replay_routing: {self.name} runs more forwards than were recorded")
            return self.replaying.popleft(), True, checkpointed
        return None, checkpointed and self.in_recompute, checkpointed

    def before(self, block: nn.Module, args) -> None:
        """Forward pre-hook of the block: force (or keep) its top-k."""
        if torch.compiler.is_compiling():  # compiled: the compiler's recomputation replays its graph
            if self.replaying is not None:
                raise ExpertParallelError("replay_routing: a compiled forward cannot replay routing; run the "
                                          "replayed forward with the model not compiled")
            return
        indices, force, keep = self._forced(block.training)
        if force:
            replay = self.replaying is not None and not inside_backward()
            self.mode = ForcedTopK(indices, self.widths, self.top_k, keep, tally=self if replay else None)
            self.mode.__enter__()

    def after(self, block: nn.Module, args, output) -> None:
        """Forward hook of the block (also when it raises): the top-k was taken; a checkpointed forward
        keeps it."""
        if self.mode is None:
            return
        mode, self.mode = self.mode, None
        mode.__exit__(None, None, None)
        if sys.exc_info()[0] is not None:  # the block raised (a recomputation stops once it has what it needs)
            return
        if mode.chosen is None and mode.indices is None and self.replaying is None:
            # the default replay_in_recompute on a router that does not take a torch.topk (PhiMoE's sparsemixer,
            # Switch's argmax): recomputed afresh, as transformers does
            self.in_recompute = False
            warnings.warn(f"routing.replay_in_recompute: the router of {self.name} ({type(block).__name__}) does "
                          "not choose its experts with torch.topk; its recomputation routes afresh", stacklevel=2)
            return
        if mode.chosen is None:
            want = "" if mode.indices is None else f" and k={mode.indices.shape[-1]} for {mode.indices.shape[0]} tokens"
            raise ExpertParallelError(
                f"routing replay in {self.name} ({type(block).__name__}): its router did not choose its experts with "
                f"torch.topk over {self.widths[-1]} scores{want}; replay is not supported for it (set "
                "routing.replay_in_recompute: false, do not use replay_routing)"
            )
        if mode.keep:
            self.pending.append(self._stored(mode.chosen))


def _layers(model: nn.Module) -> dict[str, LayerRoutes]:
    """The replay state of every rewritten MoE layer of ``model``, by its experts holder's path."""
    return {name: installed.binding(m).routes for name, m in model.named_modules()
            if installed.binding(m) is not None}


def install_replay(model: nn.Module, in_recompute: bool) -> None:
    """Hooks on every rewritten block (the model's own block at the experts level too) that force the
    top-k when replaying; ``in_recompute``: checkpointed forwards keep their choice for the recomputation."""
    for name, holder in model.named_modules():
        binding = installed.binding(holder)
        if binding is None:
            continue
        routes = binding.routes
        routes.name, routes.in_recompute = name, in_recompute
        routes.widths = (binding.num_experts + binding.zero_experts, binding.num_experts)
        router = installed.router(holder)
        routes.top_k = router.top_k if router is not None else None
        # the router module when it takes the top-k itself (the mode then lives for the routing only)
        target = holder if router is None else router.router_module() if router.chooses else router.block
        target.register_forward_pre_hook(routes.before)
        target.register_forward_hook(routes.after, always_call=True)  # the mode leaves however it ends


def replay_disagreement(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(replayed, disagreed)`` token-layer counts of the replays since the last call (device tensors,
    summed over the layers; None when nothing was replayed): how often the routers, left alone, would
    have chosen other experts than the replayed ones."""
    layers = [layer for layer in _layers(model).values() if layer.replayed is not None]
    if not layers:
        return None
    replayed = torch.stack([layer.replayed for layer in layers]).sum()
    disagreed = torch.stack([layer.disagreed for layer in layers]).sum()
    for layer in layers:
        layer.replayed = layer.disagreed = None
    return replayed, disagreed


class Routes:
    """Recorded routing: per MoE layer (its experts holder's path), the ``[T, K]`` experts of each forward,
    in order (a row of ``-1``: the router chooses). :meth:`save` / :meth:`load` write and read them as one
    safetensors file."""

    def __init__(self, layers: dict[str, list[torch.Tensor]] | None = None) -> None:
        self.layers = layers if layers is not None else {}

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_file({f"{name}/{i}": t.contiguous() for name, calls in self.layers.items() for i, t in enumerate(calls)},
                  str(path))

    @classmethod
    def load(cls, path: str | Path) -> Routes:
        from safetensors.torch import load_file

        layers: dict[str, list[torch.Tensor]] = {}
        for key, t in sorted(load_file(str(path)).items(), key=lambda kv: (kv[0].rsplit("/", 1)[0],
                                                                            int(kv[0].rsplit("/", 1)[1]))):
            layers.setdefault(key.rsplit("/", 1)[0], []).append(t)
        return cls(layers)


@contextmanager
def record_routing(model: nn.Module):
    """Record the experts every rewritten layer chooses in the forwards run inside (a rollout, a
    generation's steps): ``with record_routing(model) as routes:``; ``routes.layers`` fills in."""
    layers = _layers(model)
    routes = Routes({name: [] for name in layers})
    for name, layer in layers.items():
        layer.recording = routes.layers[name]
    try:
        yield routes
    finally:
        for layer in layers.values():
            layer.recording = None


@contextmanager
def replay_routing(model: nn.Module, routes: Routes):
    """Inside, each rewritten layer's forwards use the recorded experts, in the order recorded (the
    routing weights and the router's gradient from the current logits at those experts); every
    recorded forward must be replayed."""
    layers = _layers(model)
    if set(routes.layers) != set(layers):
        raise ExpertParallelError(
            f"replay_routing: the routes were recorded for the layers {sorted(routes.layers)[:3]}..., this model's "
            f"rewritten layers are {sorted(layers)[:3]}...; record them on the same model"
        )
    for name, layer in layers.items():
        layer.replaying = deque(routes.layers[name])
    try:
        yield routes
        left = {name: len(layer.replaying) for name, layer in layers.items() if layer.replaying}
        if left:
            raise ExpertParallelError(f"replay_routing: recorded forwards not replayed: {left}")
    finally:
        for layer in layers.values():
            layer.replaying = None
