"""Ascend grouped GEMM argument construction and autograd, on CPU against the documented semantics."""

from __future__ import annotations

import pytest
import torch

from hp_rewrite.kernels import npu

IN, OUT = 6, 5

COUNTS = [
    [3, 0, 4, 1],  # an expert with zero rows in the middle
    [0, 0, 5, 0],  # zero rows at both ends
    [2, 2, 2, 2],
    [7],  # a single expert
    [0, 0, 0],  # zero total rows
]


def _loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    pieces, start = [], 0
    for i, c in enumerate(counts):
        pieces.append(x[start : start + c] @ w[i])
        start += c
    return torch.cat(pieces)


def _inputs(counts: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), IN, generator=gen)
    w = torch.randn(len(counts), IN, OUT, generator=gen)
    return x, w


def test_npu_not_available_here() -> None:
    assert npu.available() is False


@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_args_shape(counts: list[int]) -> None:
    x, w = _inputs(counts)
    args = npu.grouped_matmul_args(x, w, counts)
    assert args["group_list"].dtype == torch.int64
    assert args["group_list"].tolist() == torch.tensor(counts).cumsum(0).tolist()
    assert args["split_item"] == 3 and args["group_type"] == 0 and args["group_list_type"] == 0
    assert args["bias"] is None
    assert len(args["x"]) == 1 and len(args["weight"]) == 1
    assert args["x"][0].is_contiguous() and args["weight"][0].is_contiguous()


@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_reference_kernel_equals_per_expert_matmul(counts: list[int]) -> None:
    x, w = _inputs(counts)
    (out,) = npu.reference_grouped_matmul(**npu.grouped_matmul_args(x, w, counts))
    assert out.shape == (sum(counts), OUT)
    assert torch.equal(out, _loop(x, w, counts))


def test_args_make_transposed_weights_contiguous() -> None:
    counts = [2, 3]
    x, w = _inputs(counts)
    w_out_in = w.transpose(1, 2).contiguous()
    args = npu.grouped_matmul_args(x, w_out_in.transpose(1, 2), counts)
    assert args["weight"][0].is_contiguous()
    (out,) = npu.reference_grouped_matmul(**args)
    torch.testing.assert_close(out, _loop(x, w, counts), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_grouped_matmul_forward_backward(counts: list[int]) -> None:
    x, w = _inputs(counts, seed=1)
    upstream = torch.randn(sum(counts), OUT, generator=torch.Generator().manual_seed(2))

    x1, w1 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = npu.grouped_matmul(x1, w1, counts, kernel=npu.reference_grouped_matmul)
    (out * upstream).sum().backward()

    x2, w2 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = _loop(x2, w2, counts)
    (ref * upstream).sum().backward()

    assert out.shape == ref.shape
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert x1.grad is not None and w1.grad is not None
    assert x1.grad.shape == x.shape and w1.grad.shape == w.shape
    assert torch.allclose(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)
    assert torch.allclose(w1.grad, w2.grad, rtol=1e-6, atol=1e-6)
    for i, c in enumerate(counts):  # experts without rows get a zero weight gradient
        if c == 0:
            assert w1.grad[i].abs().sum() == 0


def test_grouped_matmul_uses_the_injected_kernel() -> None:
    counts = [1, 2]
    x, w = _inputs(counts)
    calls = []

    def kernel(**kwargs):
        calls.append(kwargs["group_list"].tolist())
        return npu.reference_grouped_matmul(**kwargs)

    out = npu.grouped_matmul(x.requires_grad_(True), w, counts, kernel=kernel)
    out.sum().backward()
    assert calls == [[1, 3], [1, 3]]  # forward, then dx in backward
