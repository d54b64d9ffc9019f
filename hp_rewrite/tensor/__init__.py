"""Tensor and sequence parallelism of the dense parts, beside the routed runtime.

:func:`plan_layout` decides which module is split how (transformers' ``base_model_tp_plan`` minus the
experts, the matched structure elsewhere, refusals with the reason); :func:`parallelize` applies it
with torch's DTensor tensor-parallel API. The experts are never split: the runtime shares the TP
group's tokens out in ``dispatch`` and exchanges them over the extended EP group.
"""

from .apply import parallelize
from .errors import TensorParallelError
from .layout import MoeBlockSpec, TensorLayout, plan_layout

__all__ = ["MoeBlockSpec", "TensorLayout", "TensorParallelError", "parallelize", "plan_layout"]
