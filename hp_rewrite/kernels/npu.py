"""Ascend NPU expert compute through torch_npu: grouped GEMMs and the grouped SwiGLU MLP.

``npu_grouped_matmul`` (torch_npu API reference; ``../shared/reference/ascend-kernels.md``) takes
lists of tensors and has no autograd, so the backward is spelled out here with the same op:

* m-grouped (``group_type=0``, ``split_item=3``): ``x=[[N, in]]``, ``weight=[[E, in, out]]``, rows
  split by ``group_list`` (cumulative ends, ``group_list_type=0``) -> ``[[N, out]]``. Forward and the
  input gradient (against the transposed weights).
* k-grouped (``group_type=2``): ``x=[[in, N]]``, ``weight=[[N, out]]`` -> ``[[E, in, out]]``: every
  expert's weight gradient ``x_e^T dy_e`` in one call, no per-expert loop.

:class:`GroupedSwiGLU` is the whole expert MLP (gate_up GEMM, activation, down GEMM) as one autograd
function. The activation is ``npu_swiglu(h, -1)`` for a plain SiLU-gated ``[gate | up]`` layout and
the module's own gate otherwise (gpt-oss's clamped interleaved gate, a non-gated ``act_fn``); its
gradient comes from that function's own autograd (``npu_swiglu_backward`` for ``npu_swiglu``),
recomputed from the saved pre-activation in the backward. Limits of the single-tensor m-grouped
case: at most :data:`MAX_GROUPS` groups and every inner dimension below :data:`MAX_INNER`
(:func:`limits_problem`); the caller falls back to torch's grouped GEMM beyond them.

Every call goes through an injectable ``kernel`` (``npu_grouped_matmul`` by default) so the argument
construction and the autograd run on CPU against :func:`reference_grouped_matmul` or a torch_npu
stand-in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from ..errors import UserError

MAX_GROUPS = 1024  # npu_grouped_matmul: at most this many groups
MAX_INNER = 65536  # ... and every inner (reduction) dimension strictly below this

Kernel = Callable[..., list]
Defer = Callable[[Callable[[], torch.Tensor]], None]  # takes over a weight gradient: called with its computation


def available() -> bool:
    """True when torch_npu imports (an Ascend build, or a stand-in on the path)."""
    try:
        importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - any import failure means no NPU path
        return False
    return True


def limits_problem(groups: int, dims: tuple[int, ...]) -> str | None:
    """Why ``npu_grouped_matmul`` cannot take this problem, or None when it can."""
    if groups > MAX_GROUPS:
        return f"{groups} local experts > {MAX_GROUPS} groups of npu_grouped_matmul"
    big = [d for d in dims if d >= MAX_INNER]
    if big:
        return f"inner dimension {big[0]} >= {MAX_INNER} (npu_grouped_matmul limit)"
    return None


def _ends(counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device)


def grouped_matmul_args(x: torch.Tensor, weight_in_out: torch.Tensor, counts: list[int],
                        ends: torch.Tensor | None = None) -> dict:
    """``npu_grouped_matmul`` keywords for ``x_e @ W_e`` over rows grouped by expert (m-grouped).
    ``ends``: the cumulative ends already on the device (one host-to-device copy per MLP, not per call)."""
    return {
        "x": [x.contiguous()],
        "weight": [weight_in_out.contiguous()],
        "bias": None,
        "group_list": _ends(counts, x.device) if ends is None else ends,
        "split_item": 3,
        "group_type": 0,
        "group_list_type": 0,
    }


def weight_grad_args(x: torch.Tensor, dy: torch.Tensor, counts: list[int], ends: torch.Tensor | None = None) -> dict:
    """``npu_grouped_matmul`` keywords for ``x_e^T @ dy_e`` of every expert (k-grouped): ``[E, in, out]``."""
    return {
        "x": [x.t()],
        "weight": [dy.contiguous()],
        "bias": None,
        "group_list": _ends(counts, x.device) if ends is None else ends,
        "split_item": 3,
        "group_type": 2,
        "group_list_type": 0,
    }


def reference_grouped_matmul(x, weight, bias=None, group_list=None, split_item=0, group_type=None,
                             group_list_type=0, **_):
    """Plain-torch statement of the documented semantics (single tensors, split_item 2/3, group_type 0 or 2)."""
    assert split_item in (2, 3) and group_type in (0, 2) and group_list_type in (0, 1) and bias is None
    (xs,), (w,) = x, weight
    sizes = [int(n) for n in group_list.tolist()]
    ends = sizes if group_list_type == 0 else torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    spans = list(zip(starts, ends, strict=True))
    if group_type == 0:  # x [N, in] rows by group, w [E, in, out]
        assert len(ends) == w.shape[0] and (not ends or ends[-1] == xs.shape[0]), "group_list must end at N"
        out = [xs[s:e] @ w[i] for i, (s, e) in enumerate(spans)]
        return [torch.cat(out) if out else xs.new_empty((0, w.shape[-1]))]
    assert not ends or ends[-1] == xs.shape[1] == w.shape[0], "group_list must end at the k extent"
    return [torch.stack([xs[:, s:e] @ w[s:e] for s, e in spans])]


def _npu_grouped_matmul(**kwargs):
    import torch_npu  # noqa: PLC0415 - optional dependency, imported on use only

    return torch_npu.npu_grouped_matmul(**kwargs)


def npu_swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over ``h = [gate | up]`` with torch_npu's fused op (it has its own backward)."""
    import torch_npu  # noqa: PLC0415

    return torch_npu.npu_swiglu(h.contiguous(), dim=-1)


def _m(kernel: Kernel, x: torch.Tensor, w_in_out: torch.Tensor, counts: list[int], ends: torch.Tensor
       ) -> torch.Tensor:
    return kernel(**grouped_matmul_args(x, w_in_out, counts, ends))[0]


def _dw(kernel: Kernel, x: torch.Tensor, dy: torch.Tensor, counts: list[int], w: torch.Tensor,
        ends: torch.Tensor) -> torch.Tensor:
    if not counts:
        return torch.zeros_like(w)
    return kernel(**weight_grad_args(x, dy, counts, ends))[0]


def _first_order_only() -> None:
    if torch.is_grad_enabled():
        raise UserError("runtime.compute npu: the torch_npu expert backward is first order only (create_graph=True "
                        "asked for a differentiable backward); use compute grouped or eager for double backward")


def _weight_grad(ctx, i: int, defer: Defer | None, compute: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """The weight gradient now, or handed to ``defer`` (``runtime.defer_expert_grads``), or not needed."""
    if defer is not None:
        defer(compute)
        return None
    return compute() if ctx.needs_input_grad[i] else None


class GroupedMatmul(torch.autograd.Function):
    """Grouped ``x_e @ W_e``: forward and input gradient m-grouped, weight gradient k-grouped (one call each)."""

    @staticmethod
    def forward(ctx, x, weight_in_out, counts, kernel, defer, ends):  # type: ignore[override]
        ends = _ends(counts, x.device) if ends is None else ends
        ctx.save_for_backward(x, weight_in_out, ends)
        ctx.counts, ctx.kernel, ctx.defer = counts, kernel, defer
        return _m(kernel, x, weight_in_out, counts, ends)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _first_order_only()
        x, w, ends = ctx.saved_tensors
        grad, k, counts = grad.contiguous(), ctx.kernel, ctx.counts
        dx = _m(k, grad, w.transpose(1, 2), counts, ends) if ctx.needs_input_grad[0] else None
        dw = _weight_grad(ctx, 1, ctx.defer, lambda: _dw(k, x, grad, counts, w, ends))
        return dx, dw, None, None, None, None


def grouped_matmul(x: torch.Tensor, weight_in_out: torch.Tensor, counts: list[int], kernel: Kernel | None = None,
                   defer: Defer | None = None, ends: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable grouped GEMM on Ascend (``kernel`` defaults to ``npu_grouped_matmul``). ``ends``: the
    cumulative group ends already on the device (int64); else made from ``counts`` (a host-to-device copy)."""
    return GroupedMatmul.apply(x, weight_in_out, list(counts), kernel or _npu_grouped_matmul, defer, ends)


class GroupedSwiGLU(torch.autograd.Function):
    """``act(x_e @ Wgu_e) @ Wd_e`` for every expert: two m-grouped GEMMs around the activation.

    Backward: ``da = dy Wd^T`` (m-grouped), ``dWd = a^T dy`` (k-grouped), ``dh`` from the activation's
    own autograd on the saved pre-activation, ``dx = dh Wgu^T`` (m-grouped), ``dWgu = x^T dh`` (k-grouped).
    """

    @staticmethod
    def forward(ctx, x, w_up, w_down, counts, kernel, activation, defer_up, defer_down, ends):  # type: ignore[override]
        ends = _ends(counts, x.device) if ends is None else ends
        h = _m(kernel, x, w_up, counts, ends)
        y = _m(kernel, activation(h), w_down, counts, ends)
        ctx.save_for_backward(x, h, w_up, w_down, ends)
        ctx.counts, ctx.kernel, ctx.activation, ctx.defer = counts, kernel, activation, (defer_up, defer_down)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        _first_order_only()
        x, h, w_up, w_down, ends = ctx.saved_tensors
        dy, k, counts = dy.contiguous(), ctx.kernel, ctx.counts
        da = _m(k, dy, w_down.transpose(1, 2), counts, ends)
        with torch.enable_grad():
            h_in = h.detach().requires_grad_(True)
            a = ctx.activation(h_in)
        (dh,) = torch.autograd.grad(a, h_in, da)
        a = a.detach()
        dh = dh.contiguous()
        dw_down = _weight_grad(ctx, 2, ctx.defer[1], lambda: _dw(k, a, dy, counts, w_down, ends))
        dx = _m(k, dh, w_up.transpose(1, 2), counts, ends) if ctx.needs_input_grad[0] else None
        dw_up = _weight_grad(ctx, 1, ctx.defer[0], lambda: _dw(k, x, dh, counts, w_up, ends))
        return dx, dw_up, dw_down, None, None, None, None, None, None


def grouped_swiglu(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, counts: list[int],
                   activation: Callable[[torch.Tensor], torch.Tensor] | None = None, kernel: Kernel | None = None,
                   defer: tuple[Defer | None, Defer | None] = (None, None),
                   ends: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped expert MLP on Ascend; ``activation`` defaults to ``npu_swiglu`` (``[gate | up]`` halves);
    ``ends`` as for :func:`grouped_matmul`."""
    return GroupedSwiGLU.apply(x, w_up, w_down, list(counts), kernel or _npu_grouped_matmul,
                               activation or npu_swiglu, *defer, ends)
