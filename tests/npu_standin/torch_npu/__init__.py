"""A torch_npu stand-in for CPU tests: the documented semantics of the ops hp_rewrite calls, in plain torch.

Only ``tests/npu_*`` put this directory on the path (``sys.path`` inside spawned ranks, ``PYTHONPATH``
for ``hp-rewrite apply`` subprocess ranks); it is never importable elsewhere. Semantics from the
torch_npu API reference (../shared/reference/ascend-kernels.md). ``CALLS`` counts every call so a test
proves the forward, input-gradient, weight-gradient and activation calls reached the stand-in.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

__version__ = "0.0-standin"
STANDIN = True
CALLS: Counter = Counter()


def _ends(group_list: torch.Tensor, group_list_type: int) -> list[int]:
    assert group_list.dtype == torch.int64 and group_list.dim() == 1, "group_list: 1-D int64"
    values = [int(v) for v in group_list.tolist()]
    if group_list_type == 1:  # counts
        out, total = [], 0
        for v in values:
            total += v
            out.append(total)
        return out
    assert group_list_type == 0, f"group_list_type {group_list_type}"
    assert all(a <= b for a, b in zip(values, values[1:], strict=False)), "cumulative ends must not decrease"
    return values


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    assert isinstance(x, list) and isinstance(weight, list) and len(x) == 1 and len(weight) == 1, "single tensors"
    assert bias is None and act_type == 0 and output_dtype is None, "non-quantized, no fused activation"
    assert split_item in (2, 3), "one concatenated output"
    (xs,), (w,) = x, weight
    assert xs.dtype in (torch.float16, torch.bfloat16, torch.float32) and xs.dtype == w.dtype, (xs.dtype, w.dtype)
    ends = _ends(group_list, group_list_type)
    starts = [0, *ends[:-1]]
    if group_type == 0:  # m-grouped: x [N, in], weight [E, in, out] -> [N, out]
        assert xs.dim() == 2 and w.dim() == 3 and xs.shape[1] == w.shape[1], (xs.shape, w.shape)
        assert xs.is_contiguous(), "x must not be transposed"
        assert len(ends) == w.shape[0] <= 1024, "one group per weight, at most 1024"
        assert w.shape[1] < 65536, "inner dim < 65536"
        assert ends[-1] == xs.shape[0], "group_list ends at the row count"
        CALLS["grouped_matmul_m"] += 1
        out = torch.cat([xs[s:e] @ w[i] for i, (s, e) in enumerate(zip(starts, ends, strict=True))])
        return [out]
    if group_type == 2:  # k-grouped: x [in, N], weight [N, out] -> [E, in, out]
        assert xs.dim() == 2 and w.dim() == 2 and xs.shape[1] == w.shape[0], (xs.shape, w.shape)
        assert len(ends) <= 1024 and ends[-1] == xs.shape[1], "group_list ends at the k extent"
        CALLS["grouped_matmul_k"] += 1
        return [torch.stack([xs[:, s:e] @ w[s:e] for s, e in zip(starts, ends, strict=True)])]
    raise AssertionError(f"group_type {group_type} not used by hp_rewrite")


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.save_for_backward(x)
        ctx.dim = dim
        a, b = x.chunk(2, dim)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad):
        CALLS["swiglu_backward"] += 1
        (x,) = ctx.saved_tensors
        a, b = x.float().chunk(2, ctx.dim)
        g, s = grad.float(), torch.sigmoid(a.float())
        da = g * b * (s * (1 + a * (1 - s)))  # d silu(a) = s (1 + a (1 - s))
        db = g * a * s
        return torch.cat([da, db], ctx.dim).to(x.dtype), None


def npu_swiglu(input, dim=-1):  # noqa: A002 - torch_npu's own parameter name
    assert input.is_contiguous(), "npu_swiglu needs a contiguous input"
    assert input.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert input.shape[dim] % 2 == 0
    CALLS["swiglu"] += 1
    return _SwiGLU.apply(input, dim)


# npu_moe_token_permute / npu_moe_token_unpermute: the reference semantics MindSpeed and Megatron give for the
# fused ops. permute: the flattened ``indices [T, K]`` sorted stably, ``sorted_indices`` = that argsort (int32),
# row i = tokens[sorted_indices[i] // K], cut to ``num_out_tokens``. unpermute: row sorted_indices[i] of a
# zero [T*K, H] gets permuted[i]; with probs [T, K] each token sums its K rows times probs (K = 1 without).
class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, indices, num_out_tokens):
        top_k = 1 if indices.dim() == 1 else indices.shape[1]
        sorted_indices = torch.sort(indices.reshape(-1), stable=True).indices
        if num_out_tokens is not None:
            sorted_indices = sorted_indices[:num_out_tokens]
        ctx.save_for_backward(sorted_indices)
        ctx.top_k, ctx.num_tokens = top_k, tokens.shape[0]
        permuted = tokens.index_select(0, torch.div(sorted_indices, top_k, rounding_mode="floor"))
        sorted_indices = sorted_indices.to(torch.int32)
        ctx.mark_non_differentiable(sorted_indices)
        return permuted, sorted_indices

    @staticmethod
    def backward(ctx, grad, _):
        CALLS["token_permute_backward"] += 1
        (sorted_indices,) = ctx.saved_tensors
        slots = grad.new_zeros((ctx.num_tokens * ctx.top_k, grad.shape[-1])).index_copy(0, sorted_indices, grad)
        return slots.view(ctx.num_tokens, ctx.top_k, -1).sum(1), None, None


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    assert not padded_mode, "padded_mode=True is not supported"
    assert tokens.dim() == 2 and indices.dim() in (1, 2) and indices.shape[0] == tokens.shape[0], (tokens.shape,
                                                                                                  indices.shape)
    assert not indices.is_floating_point(), "indices: integer expert ids"
    CALLS["token_permute"] += 1
    return _Permute.apply(tokens, indices, num_out_tokens)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, sorted_indices, probs):
        top_k = 1 if probs is None else probs.shape[1]
        rows = permuted.shape[0] if probs is None else probs.numel()
        index = sorted_indices.long()
        ctx.save_for_backward(index, permuted if probs is not None else None, probs)
        ctx.top_k = top_k
        out = permuted.new_zeros((rows, permuted.shape[-1])).index_copy(0, index, permuted)
        out = out.view(-1, top_k, permuted.shape[-1])
        if probs is not None:
            out = out * probs.unsqueeze(-1)
        return out.sum(1)

    @staticmethod
    def backward(ctx, grad):
        CALLS["token_unpermute_backward"] += 1
        index, permuted, probs = ctx.saved_tensors
        slots = grad.unsqueeze(1).expand(-1, ctx.top_k, -1)
        grad_probs = None
        if probs is not None:
            unsorted = permuted.new_zeros((probs.numel(), permuted.shape[-1])).index_copy(0, index, permuted)
            grad_probs = (unsorted.view_as(slots) * slots).sum(-1).to(probs.dtype)
            slots = slots * probs.unsqueeze(-1)
        return slots.reshape(-1, grad.shape[-1]).index_select(0, index), None, grad_probs


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    assert not padded_mode and restore_shape is None, "padded_mode / restore_shape are not supported"
    assert sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1, "sorted_indices: 1-D int32"
    assert sorted_indices.shape[0] == permuted_tokens.shape[0], (sorted_indices.shape, permuted_tokens.shape)
    CALLS["token_unpermute"] += 1
    return _Unpermute.apply(permuted_tokens, sorted_indices, probs)
