"""Routers as pure functions, numerically identical to the transformers routers they mirror.

Every router returns :class:`RouterOutput` ``(logits, weights, indices)``, the same contract as a
transformers router module, so generated code can swap an inlined router for the model's own module
(``call_router_module``) without changing anything downstream.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ExpertParallelError

WeightsDtype = Literal["fp32", "logits"]


class RouterOutput(NamedTuple):
    """``logits [T,E]`` (what the auxiliary loss records), ``weights [T,K]``, ``indices [T,K]`` int64."""

    logits: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor


def softmax_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = False,
    scaling: float | None = None,
    weights_dtype: WeightsDtype = "logits",
) -> RouterOutput:
    """Softmax over experts in fp32, then top-k of the probabilities (Mixtral, Qwen-MoE, OLMoE, ...).

    renormalize: divide the k weights by their sum (Mixtral always; Qwen when ``norm_topk_prob``).
    scaling: multiply the weights by this factor afterwards (routed scaling factor), if given.
    weights_dtype: ``fp32`` keeps the fp32 weights (Mixtral, MiniMax); ``logits`` casts them back to the
        logits dtype (Qwen, OLMoE).
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling is not None:
        weights = weights * scaling
    if weights_dtype == "logits":
        weights = weights.to(logits.dtype)
    return RouterOutput(logits, weights, indices)


def sigmoid_group(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    *,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    masked_fill: float = float("-inf"),
    weights_dtype: WeightsDtype = "fp32",
) -> RouterOutput:
    """DeepSeek-V3 style router: fp32 linear, sigmoid scores, group-limited top-k.

    The correction bias only changes which experts are *selected*; the weights are gathered from the
    unbiased sigmoid scores. A group's score is the sum of its two best biased scores; experts of the
    ``num_groups - topk_groups`` worst groups are filled with ``masked_fill`` (-inf for DeepSeek-V3,
    0.0 for families that use 0.0) before the top-k. Renormalisation adds 1e-20 to the denominator.
    """
    num_experts = weight.shape[0]
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), weight.float())
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if num_groups > 1:
        if num_experts % num_groups != 0:
            raise ExpertParallelError(f"num_groups={num_groups} does not divide num_experts={num_experts}")
        per_group = num_experts // num_groups
        group_scores = choice.view(-1, num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(-1, num_groups, per_group).reshape(-1, num_experts)
        choice = choice.masked_fill(~keep.bool(), masked_fill)
    indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    if weights_dtype == "logits":
        weights = weights.to(hidden.dtype)
    return RouterOutput(logits, weights, indices)


def from_dispatch_masks(masks: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [T, K], weights [T, K])`` of one-hot dispatch masks ``[T, K, E]`` with their weights
    ``[T, K]`` (Switch Transformers' router output): a slot whose mask row is all zero was dropped for
    capacity and gets weight 0 (its expert output is computed and multiplied by 0, so it contributes
    nothing, to the output or to any gradient)."""
    hits = masks.sum(-1)
    if not torch.compiler.is_compiling() and bool((hits > 1).any()):
        raise ExpertParallelError("dispatch masks with more than one expert per slot: not a top-k routing")
    weights = weights.reshape(hits.shape)
    return masks.argmax(-1), torch.where(hits > 0, weights, torch.zeros_like(weights))


def call_router_module(router: nn.Module, hidden: torch.Tensor, *args, **kwargs) -> RouterOutput:
    """Call a model's own router module (``topk_router_module``): exact by construction.

    The module must return ``(logits, weights, indices, ...)`` like transformers routers do; extra
    outputs are ignored. Calling the module (not its weights) keeps hooks and output recorders working,
    so ``output_router_logits=True`` still sees the logits.
    """
    out = router(hidden, *args, **kwargs)
    if not isinstance(out, (tuple, list)) or len(out) < 3:
        raise ExpertParallelError(
            f"router {type(router).__name__} returned {type(out).__name__}; the topk_router_module contract "
            "needs (logits, weights, indices)"
        )
    logits, weights, indices = out[0], out[1], out[2]
    if weights.shape != indices.shape or indices.dtype not in (torch.int64, torch.int32):
        raise ExpertParallelError(
            f"router {type(router).__name__}: weights {tuple(weights.shape)} and indices "
            f"{tuple(indices.shape)} {indices.dtype} do not form a top-k routing"
        )
    return RouterOutput(logits, weights, indices.long())
