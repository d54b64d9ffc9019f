"""Device compute backends for the local experts (below the runtime): torch grouped GEMM, the eager
loop, a batched matmul, and Ascend's torch_npu ops (:mod:`.npu`), chosen by one rule (:func:`choose`)."""

from . import npu, npu_permute
from .registry import BACKENDS, COMPUTE_KINDS, Backend, KernelChoice, KernelProblem, choose, compute_for

__all__ = ["BACKENDS", "COMPUTE_KINDS", "Backend", "KernelChoice", "KernelProblem", "choose", "compute_for", "npu",
           "npu_permute"]
