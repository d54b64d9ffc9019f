"""What one MoE layer dispatches with (:class:`ExpertParallelBinding`): everything :func:`~.dispatch.dispatch`
needs beside the tokens and their routing, so a call never passes a setting twice."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..group.groups import ExpertParallelGroup, ExpertPlacement
from ..options import RuntimeOptions
from ..overlap.context import ExchangeRuntime
from ..routing.replay import LayerRoutes


@dataclass(frozen=True)
class ExpertParallelBinding:
    """What one MoE layer dispatches with: its EP group, which experts each rank holds, the runtime
    options, the exchange runtime its layers share, its identity experts and its routes for replay.
    An installed holder carries one (``binding_of``); a caller without one builds it
    (:meth:`for_experts`)."""

    ep: ExpertParallelGroup
    placement: ExpertPlacement
    options: RuntimeOptions
    # the deferred-gradient queue and turn hook its exchanges get (the model's, shared by its layers)
    runtime: ExchangeRuntime = field(default_factory=ExchangeRuntime, compare=False, repr=False)
    zero_experts: int = 0  # identity experts after the routed ones: computed locally, never dispatched
    # what routing replay keeps and hands out for this layer (runtime.routing.replay)
    routes: LayerRoutes = field(default_factory=LayerRoutes, compare=False, repr=False)

    @property
    def num_experts(self) -> int:
        return self.placement.num_experts

    @classmethod
    def for_experts(cls, num_experts: int, ep: ExpertParallelGroup, options: RuntimeOptions | None = None, *,
                    placement: ExpertPlacement | None = None, runtime: ExchangeRuntime | None = None,
                    zero_experts: int = 0) -> ExpertParallelBinding:
        """A binding for ``num_experts`` experts over ``ep`` (default placement: consecutive blocks of
        experts per rank; default options and a runtime of its own)."""
        placement = placement or ExpertPlacement(num_experts, ep.size, ep.rank)
        if (placement.num_experts, placement.ep_size) != (num_experts, ep.size):
            raise ValueError(f"placement of {placement.num_experts} experts over {placement.ep_size} ranks used for "
                             f"num_experts={num_experts} at ep_size={ep.size}")
        return cls(ep, placement, options or RuntimeOptions(), runtime or ExchangeRuntime(), zero_experts)
