"""``torch._grouped_mm`` as a custom op that ``torch.compile`` can trace for every dtype.

The op's own fake (meta) function accepts bf16 only, the CUDA kernel's limit, while the CPU kernel
also runs fp32 and fp16; under ``torch.compile`` a CPU fp32 model would fail to trace. Wrapped as
``hp_rewrite::grouped_mm`` with a shape-only fake function and its backward spelled out with the
same kernel (m-grouped for the input gradient, k-grouped for the weight gradient), the whole local
expert compute stays one compiled region. Eager code calls ``torch._grouped_mm`` directly.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("hp_rewrite::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [N, in]`` rows grouped by ``offs`` (cumulative ends) times ``w [E, in, out]``: ``[N, out]``."""
    return torch._grouped_mm(x, w, offs=offs)


@grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty((x.shape[0], w.shape[-1]))


@torch.library.custom_op("hp_rewrite::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x_e^T @ dy_e`` per group: the weight gradient ``[E, in, out]`` (k-grouped GEMM)."""
    return torch._grouped_mm(x.t(), dy, offs=offs)


@grouped_mm_weight_grad.register_fake
def _(x, dy, offs):
    return x.new_empty((offs.shape[0], x.shape[1], dy.shape[1]))


def _setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy):
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = grouped_mm(dy, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_weight_grad(x, dy, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup)
