"""Router parity: our pure-function routers against the real transformers router modules.

Every router is built tiny from its config (no downloads), its weights are randomised (transformers
initialises them to zeros or leaves them empty), and our output must be the module's: the chosen experts
exactly, the logits and weights to rounding (two programs, the same steps each with its own calls).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from hp_rewrite.runtime import call_router_module, sigmoid_group, softmax_topk
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.routing.routers import RouterOutput

HIDDEN = 32
TOKENS = 48
DTYPES = [torch.float32, torch.bfloat16]
# logits and weights of two programs, relative to the largest entry: fp32 the suite's TOL (a few roundings
# apart); bf16 one rounding of the cast (a bf16 step is at most 2**-7 of the value)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _randomise(router: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if getattr(router, "bias", None) is not None:
            router.bias.copy_(torch.randn(router.bias.shape, generator=gen) * 0.1)
        if hasattr(router, "e_score_correction_bias"):
            # non-zero, both signs, large enough to change the selection
            bias = torch.randn(router.e_score_correction_bias.shape, generator=gen) * 0.3
            bias[::3] = -bias[::3].abs() - 0.05
            router.e_score_correction_bias.copy_(bias)
    return router


def _hidden(dtype: torch.dtype, seed: int = 1, shape: tuple[int, ...] = (TOKENS, HIDDEN)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def mixtral_router() -> MixtralTopKRouter:
    cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
    return _randomise(MixtralTopKRouter(cfg), seed=10)


def qwen3_router(norm: bool) -> Qwen3MoeTopKRouter:
    cfg = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm,
    )
    return _randomise(Qwen3MoeTopKRouter(cfg), seed=11)


def deepseek_router(norm: bool) -> DeepseekV3TopkRouter:
    cfg = DeepseekV3Config(
        hidden_size=HIDDEN,
        intermediate_size=16,
        moe_intermediate_size=16,
        n_group=4,
        topk_group=2,
        n_routed_experts=16,
        num_experts_per_tok=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm,
    )
    router = _randomise(DeepseekV3TopkRouter(cfg), seed=12)
    assert (router.e_score_correction_bias < 0).any() and (router.e_score_correction_bias > 0).any()
    return router


def gpt_oss_router() -> GptOssTopKRouter:
    cfg = GptOssConfig(hidden_size=HIDDEN, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
    return _randomise(GptOssTopKRouter(cfg), seed=13)


def ours_mixtral(router: MixtralTopKRouter, h: torch.Tensor) -> RouterOutput:
    return softmax_topk(F.linear(h, router.weight), router.top_k, renormalize=True, weights_dtype="fp32")


def ours_qwen3(router: Qwen3MoeTopKRouter, h: torch.Tensor) -> RouterOutput:
    return softmax_topk(
        F.linear(h, router.weight), router.top_k, renormalize=router.norm_topk_prob, weights_dtype="logits"
    )


def ours_deepseek(router: DeepseekV3TopkRouter, h: torch.Tensor) -> RouterOutput:
    return sigmoid_group(
        h,
        router.weight,
        router.e_score_correction_bias,
        router.top_k,
        num_groups=router.num_group,
        topk_groups=router.topk_group,
        renormalize=router.norm_topk_prob,
        scaling=router.routed_scaling_factor,
        masked_fill=float("-inf"),
    )


CASES = {
    "mixtral": (mixtral_router, ours_mixtral, "fp32"),
    "qwen3-norm": (lambda: qwen3_router(True), ours_qwen3, "model"),
    "qwen3-nonorm": (lambda: qwen3_router(False), ours_qwen3, "model"),
    "deepseek_v3-norm": (lambda: deepseek_router(True), ours_deepseek, "fp32"),
    "deepseek_v3-nonorm": (lambda: deepseek_router(False), ours_deepseek, "fp32"),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _assert_agrees(ours: RouterOutput, theirs: tuple, exact: bool = False) -> None:
    """Dtypes, shapes and the chosen experts exactly; the logits and weights within TOL, or bit for bit when
    ``exact`` (the module's own outputs passed on: the same program)."""
    logits, weights, indices = theirs[:3]
    assert ours.logits.dtype == logits.dtype and ours.logits.shape == logits.shape
    assert ours.weights.dtype == weights.dtype and ours.weights.shape == weights.shape
    assert ours.indices.dtype == indices.dtype and ours.indices.shape == indices.shape
    assert torch.equal(ours.indices, indices)
    for got, want in ((ours.logits, logits), (ours.weights, weights)):
        assert torch.equal(got, want) if exact else _rel(got, want) <= TOL[want.dtype], (exact, _rel(got, want))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_router_forward_matches_the_module(case: str, dtype: torch.dtype) -> None:
    build, ours_fn, weights_kind = CASES[case]
    router = build().to(dtype)
    h = _hidden(dtype)
    with torch.no_grad():
        theirs = router(h)
        ours = ours_fn(router, h)
    _assert_agrees(ours, theirs)
    expected_weights_dtype = torch.float32 if weights_kind == "fp32" else dtype
    assert ours.weights.dtype == expected_weights_dtype
    assert ours.indices.dtype == torch.int64


@pytest.mark.parametrize("case", list(CASES))
def test_router_forward_3d_input(case: str) -> None:
    """[B, S, H] input: sigmoid_group flattens it itself, like the DeepSeek module; softmax_topk gets the
    flattened hidden states, as the modules' callers give them."""
    build, ours_fn, _ = CASES[case]
    router = build()
    h = _hidden(torch.float32, seed=3, shape=(3, 5, HIDDEN))
    with torch.no_grad():
        theirs = router(h.reshape(-1, HIDDEN))
        ours = ours_fn(router, h.reshape(-1, HIDDEN) if "deepseek" not in case else h)
    _assert_agrees(ours, theirs)


def test_deepseek_selection_is_group_limited_and_bias_matters() -> None:
    """Sanity of the fixture: the groups and the (negative) bias actually shape the selection."""
    router = deepseek_router(True)
    h = _hidden(torch.float32, seed=4)
    with torch.no_grad():
        ours = ours_deepseek(router, h)
        no_bias = sigmoid_group(
            h, router.weight, None, router.top_k, num_groups=4, topk_groups=2, renormalize=True, scaling=2.5
        )
        one_group = sigmoid_group(
            h,
            router.weight,
            router.e_score_correction_bias,
            router.top_k,
            num_groups=1,
            topk_groups=1,
            renormalize=True,
            scaling=2.5,
        )
    groups = ours.indices // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    assert not torch.equal(ours.indices.sort(-1).values, no_bias.indices.sort(-1).values)
    assert not torch.equal(ours.indices.sort(-1).values, one_group.indices.sort(-1).values)
    torch.testing.assert_close(ours.weights.sum(-1), torch.full((TOKENS,), 2.5))


@pytest.mark.parametrize("case", list(CASES))
def test_router_weight_grads_match(case: str) -> None:
    build, ours_fn, _ = CASES[case]
    theirs_router = build()
    ours_router = copy.deepcopy(theirs_router)
    h = _hidden(torch.float32, seed=5)
    theirs = theirs_router(h)
    ours = ours_fn(ours_router, h)
    assert torch.equal(ours.indices, theirs[2])
    upstream = torch.randn(theirs[1].shape, generator=torch.Generator().manual_seed(6))
    (theirs[1] * upstream).sum().backward()
    (ours.weights * upstream).sum().backward()
    assert theirs_router.weight.grad is not None and ours_router.weight.grad is not None
    assert ours_router.weight.grad.abs().sum() > 0
    want = theirs_router.weight.grad  # two programs: entries near zero to rounding of the largest, not of their own
    assert torch.allclose(ours_router.weight.grad, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_sigmoid_group_rejects_groups_not_dividing_experts() -> None:
    h = _hidden(torch.float32)
    weight = torch.randn(10, HIDDEN)
    with pytest.raises(ExpertParallelError, match="num_groups=4"):
        sigmoid_group(h, weight, None, 2, num_groups=4, topk_groups=2)


# --- masked_fill=0.0: a hand-written reference of the documented algorithm ----------------------------


def _reference_zero_fill_choice(h, weight, bias, num_groups, topk_groups):
    """Per token, plain torch: sigmoid scores, group score = sum of the 2 best biased scores, keep the
    ``topk_groups`` best groups, fill the other experts' choice scores with 0.0.

    Returns ``(logits, masked choice scores, unbiased scores)``; the test then checks the top-k, the
    gather of the unbiased scores, the renormalisation (+1e-20) and the scaling. The chosen set is
    checked through its choice values, because the 0.0 fill makes ties (every masked expert scores
    exactly 0.0) and which of the tied experts a top-k picks is not specified.
    """
    logits = F.linear(h.float(), weight.float())
    scores = logits.sigmoid()
    num_experts = weight.shape[0]
    per_group = num_experts // num_groups
    masked_rows = []
    for t in range(h.shape[0]):
        choice = scores[t] + bias
        group_scores = [
            float(choice[g * per_group : (g + 1) * per_group].sort(descending=True).values[:2].sum())
            for g in range(num_groups)
        ]
        best = sorted(range(num_groups), key=lambda g: -group_scores[g])[:topk_groups]
        masked = choice.clone()
        for g in range(num_groups):
            if g not in best:
                masked[g * per_group : (g + 1) * per_group] = 0.0
        masked_rows.append(masked)
    return logits, torch.stack(masked_rows), scores


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_group_zero_fill_matches_reference(renormalize: bool) -> None:
    num_experts, num_groups, topk_groups, top_k, scaling = 16, 4, 2, 6, 1.5
    gen = torch.Generator().manual_seed(21)
    h = torch.randn(64, HIDDEN, generator=gen)
    weight = torch.randn(num_experts, HIDDEN, generator=gen) * 0.5
    # strongly negative biases: some kept experts score below 0.0, so the 0.0 fill of the masked groups
    # wins over them (the case where 0.0 and -inf fills differ)
    bias = torch.randn(num_experts, generator=gen) * 0.2 - 0.6
    ours = sigmoid_group(
        h,
        weight,
        bias,
        top_k,
        num_groups=num_groups,
        topk_groups=topk_groups,
        renormalize=renormalize,
        scaling=scaling,
        masked_fill=0.0,
    )
    logits, masked_choice, scores = _reference_zero_fill_choice(h, weight, bias, num_groups, topk_groups)
    assert _rel(ours.logits, logits) <= TOL[torch.float32]  # ours against a hand fp32 linear: two programs
    assert ours.weights.dtype == torch.float32 and ours.indices.dtype == torch.int64
    for t in range(h.shape[0]):
        chosen = ours.indices[t]
        assert len(set(chosen.tolist())) == top_k
        # the chosen experts carry exactly the top-k masked choice scores (ties among the 0.0-filled)
        expected_values = masked_choice[t].sort(descending=True).values[:top_k]
        assert torch.equal(masked_choice[t][chosen].sort(descending=True).values, expected_values)
        w = scores[t][chosen]
        if renormalize:
            w = w / (w.sum() + 1e-20)
        w = w * scaling
        torch.testing.assert_close(ours.weights[t], w, rtol=1e-6, atol=1e-7)
    # the 0.0 fill really changed the routing for some tokens compared with -inf
    inf_fill = sigmoid_group(
        h,
        weight,
        bias,
        top_k,
        num_groups=num_groups,
        topk_groups=topk_groups,
        renormalize=renormalize,
        scaling=scaling,
        masked_fill=float("-inf"),
    )
    per_group = num_experts // num_groups
    ours_groups = ours.indices // per_group
    inf_groups = inf_fill.indices // per_group
    outside = [len(set(row.tolist())) > topk_groups for row in ours_groups]
    assert any(outside), "fixture does not exercise the 0.0 fill"
    assert all(len(set(row.tolist())) <= topk_groups for row in inf_groups)


# --- call_router_module -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_call_router_module_gpt_oss(dtype: torch.dtype) -> None:
    router = gpt_oss_router().to(dtype)
    h = _hidden(dtype, seed=7)
    with torch.no_grad():
        theirs = router(h)
        ours = call_router_module(router, h)
    assert isinstance(ours, RouterOutput)
    _assert_agrees(ours, theirs, exact=True)  # the module's own call: its outputs as they are


def test_call_router_module_keeps_hooks() -> None:
    router = gpt_oss_router()
    seen = []
    router.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    h = _hidden(torch.float32, seed=8)
    out = call_router_module(router, h)
    assert len(seen) == 1 and seen[0] is out.logits


def test_call_router_module_ignores_extra_outputs_and_widens_int32() -> None:
    class Extra(nn.Module):
        def forward(self, h):
            logits = h @ torch.ones(h.shape[-1], 4)
            w, i = logits.topk(2, dim=-1)
            return logits, w, i.int(), "extra"

    out = call_router_module(Extra(), _hidden(torch.float32))
    assert out.indices.dtype == torch.int64 and out.weights.shape == out.indices.shape


class _SingleTensorRouter(nn.Module):
    def forward(self, h):
        return h @ torch.ones(h.shape[-1], 4)


class _BadShapesRouter(nn.Module):
    def forward(self, h):
        logits = h @ torch.ones(h.shape[-1], 4)
        return logits, logits, logits.argmax(-1)


def test_call_router_module_rejects_single_tensor() -> None:
    with pytest.raises(ExpertParallelError, match="_SingleTensorRouter"):
        call_router_module(_SingleTensorRouter(), _hidden(torch.float32))


def test_call_router_module_rejects_non_topk_outputs() -> None:
    with pytest.raises(ExpertParallelError, match="_BadShapesRouter"):
        call_router_module(_BadShapesRouter(), _hidden(torch.float32))
