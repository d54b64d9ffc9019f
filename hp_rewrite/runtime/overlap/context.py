"""The mutable runtime state the exchanges are given: the deferred-gradient queue and the turn hook.

:class:`ExchangeRuntime` is what the MoE layers of one model share: one
:class:`~.deferred.WeightGradQueue` for all their MoE layers (``runtime.defer_expert_grads``: any
backward pass may run any queued job) and the micro-batch scheduler's turn hand-off
(:func:`~.turns.give_turn`). A layer's binding holds it; :func:`~.dispatch.dispatch` turns it into
the :class:`~.comm.WaitHooks` its exchanges get. Neither :mod:`.comm` nor the (frozen)
:class:`~.groups.ExpertParallelGroup` holds any of it.

A rewritten model has one, made by :func:`hp_rewrite.loading.install.install` and shared by all its
layers (and by deep copies of the model); a holder installed on its own gets its own. No module
keeps any of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..options import RuntimeOptions
from ..transport.comm import WaitHooks
from .deferred import WeightGradQueue
from .turns import give_turn


class ExchangeRuntime:
    """Mutable state shared by the exchanges of one model's MoE layers.

    weight_grads: the queue expert weight gradients wait in (``runtime.defer_expert_grads``).
    turn: called before every blocking wait or collective (default: the :class:`~.turns.Interleaver`'s
        turn hand-off, a no-op outside it).
    """

    def __init__(self, weight_grads: WeightGradQueue | None = None, turn: Callable[[], None] = give_turn) -> None:
        self.weight_grads = weight_grads if weight_grads is not None else WeightGradQueue()
        self.turn = turn
        self._plain = WaitHooks(turn)
        self._filled = WaitHooks(turn, self.weight_grads)
        self._side_streams: dict[str, object] = {}

    def side_stream(self, device: torch.device):
        """The stream the shared experts of these layers run on beside the exchange, one per device
        (:func:`~.dispatch.shared_beside`)."""
        key = str(device)
        if key not in self._side_streams:
            self._side_streams[key] = torch.get_device_module(device).Stream(device)
        return self._side_streams[key]

    def __deepcopy__(self, memo) -> ExchangeRuntime:
        """Shared, not copied (like the EP group): a deep copy of a model runs over the same state."""
        return self

    def defers(self, options: RuntimeOptions, ep_size: int) -> bool:
        """Whether ``defer_expert_grads`` can pay here: only where exchange waits exist."""
        return options.defer_expert_grads and options.overlap and ep_size > 1

    def queue_for(self, options: RuntimeOptions, ep_size: int) -> WeightGradQueue | None:
        """The queue a layer's expert weight gradients go to, or None (computed in place)."""
        return self.weight_grads if self.defers(options, ep_size) else None

    def hooks(self, options: RuntimeOptions, ep_size: int) -> WaitHooks:
        """What a layer's exchanges do where they block."""
        return self._filled if self.defers(options, ep_size) else self._plain
