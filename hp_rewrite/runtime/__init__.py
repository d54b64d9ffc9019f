"""The routed expert-parallel runtime: the public API that generated code calls.

router -> :func:`dispatch` (all-to-all to the ranks owning the experts) -> local experts (grouped
GEMM) -> :func:`experts_and_combine` (all-to-all back, weighted sum) -> :func:`merge_shared`.
Everything here is typed and takes its settings as arguments; nothing reads the environment.
"""

from .binding.install import (
    ExpertParallelBinding,
    binding_of,
    exchange_runtimes,
    expert_parallel_forward,
    expert_weights,
    install_expert_parallel,
    local_rows,
)
from .compute import expert_modules
from .compute.experts import (
    ExpertsLayout,
    LocalBatch,
    experts_implementation_of,
    holder_of,
    kernel_choice,
    local_experts_forward,
    resolve_compute,
    shard_experts,
)
from .errors import ExpertParallelError
from .group.groups import ExpertParallelGroup, ExpertPlacement, build_expert_parallel_group
from .options import RuntimeOptions
from .overlap.context import ExchangeRuntime
from .overlap.turns import Interleaver, interleave
from .pipeline.capacity import CapacityResult, apply_capacity, expert_capacity
from .pipeline.dispatch import (
    DispatchStats,
    RoutedDispatch,
    dispatch,
    experts_and_combine,
    moe_forward,
    shared_beside,
)
from .pipeline.input_scaled import combine_input_scaled, dispatch_input_scaled
from .pipeline.shared import SHARED_MODES, merge_shared
from .routing.routers import RouterOutput, call_router_module, sigmoid_group, softmax_topk
from .transport.comm import PendingExchange, WaitHooks, all_to_all, all_to_all_async
from .transport.exchange import DedupExchange, PerSlotExchange, TokenExchange, exchange_for

__all__ = [
    "CapacityResult",
    "DedupExchange",
    "DispatchStats",
    "ExchangeRuntime",
    "ExpertParallelBinding",
    "ExpertParallelError",
    "ExpertParallelGroup",
    "ExpertPlacement",
    "ExpertsLayout",
    "LocalBatch",
    "PendingExchange",
    "PerSlotExchange",
    "RoutedDispatch",
    "RouterOutput",
    "RuntimeOptions",
    "SHARED_MODES",
    "TokenExchange",
    "WaitHooks",
    "all_to_all",
    "all_to_all_async",
    "apply_capacity",
    "binding_of",
    "build_expert_parallel_group",
    "call_router_module",
    "combine_input_scaled",
    "dispatch",
    "dispatch_input_scaled",
    "exchange_for",
    "expert_weights",
    "expert_capacity",
    "experts_and_combine",
    "shared_beside",
    "expert_parallel_forward",
    "exchange_runtimes",
    "install_expert_parallel",
    "interleave",
    "experts_implementation_of",
    "kernel_choice",
    "local_rows",
    "Interleaver",
    "local_experts_forward",
    "merge_shared",
    "moe_forward",
    "resolve_compute",
    "shard_experts",
    "sigmoid_group",
    "softmax_topk",
    "expert_modules",
    "holder_of",
]
