"""The routed expert-parallel runtime's face: exactly the names generated code calls.

router -> :func:`dispatch` (all-to-all to the ranks owning the experts) -> local experts (grouped
GEMM) -> :func:`experts_and_combine` (all-to-all back, weighted sum) -> :func:`merge_shared`.
Everything else is imported from the room that defines it (docs/architecture.md lists the rooms).
"""

from .binding.install import binding_of, expert_parallel_forward
from .pipeline.dispatch import dispatch, experts_and_combine, shared_beside
from .pipeline.input_scaled import combine_input_scaled, dispatch_input_scaled
from .pipeline.shared import merge_shared
from .routing.routers import call_router_module, sigmoid_group, softmax_topk

__all__ = [
    "binding_of",
    "call_router_module",
    "combine_input_scaled",
    "dispatch",
    "dispatch_input_scaled",
    "experts_and_combine",
    "expert_parallel_forward",
    "merge_shared",
    "shared_beside",
    "sigmoid_group",
    "softmax_topk",
]
