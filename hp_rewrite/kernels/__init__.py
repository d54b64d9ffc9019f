"""Device compute backends for the local experts (below the runtime): torch grouped GEMM, the eager
loop, and Ascend's torch_npu ops (:mod:`.npu`), chosen by one rule (:func:`choose`)."""

from . import npu, npu_permute
from .registry import BACKENDS, COMPUTE_KINDS, Backend, KernelChoice, KernelProblem, choose

__all__ = ["BACKENDS", "COMPUTE_KINDS", "Backend", "KernelChoice", "KernelProblem", "choose", "npu", "npu_permute"]
