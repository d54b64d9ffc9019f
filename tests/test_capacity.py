"""Capacity limit: ``apply_capacity`` against a brute-force pure-Python reference."""

from __future__ import annotations

import math

import pytest
import torch

from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.pipeline.capacity import apply_capacity, expert_capacity


def reference_capacity(
    indices: list[list[int]], weights: list[list[float]], num_experts: int, factor: float, policy: str
):
    """Loops only. Slots are numbered token-major, then k. Per expert, keep ``cap`` slots: the
    highest-weight ones (ties: earlier slot) for ``probs``, the earliest ones for ``position``."""
    num_tokens, top_k = len(indices), len(indices[0])
    cap = math.ceil(factor * num_tokens * top_k / num_experts)
    slots_of: dict[int, list[tuple[float, int]]] = {e: [] for e in range(num_experts)}
    for t in range(num_tokens):
        for k in range(top_k):
            slots_of[indices[t][k]].append((weights[t][k], t * top_k + k))
    kept: set[int] = set()
    dropped = [0] * num_experts
    for e, slots in slots_of.items():
        if policy == "probs":
            ranked = sorted(slots, key=lambda s: (-s[0], s[1]))
        else:
            ranked = sorted(slots, key=lambda s: s[1])
        kept.update(pos for _, pos in ranked[:cap])
        dropped[e] = max(0, len(slots) - cap)
    new_indices = [
        [indices[t][k] if t * top_k + k in kept else num_experts for k in range(top_k)]
        for t in range(num_tokens)
    ]
    new_weights = [
        [weights[t][k] if t * top_k + k in kept else 0.0 for k in range(top_k)] for t in range(num_tokens)
    ]
    return new_indices, new_weights, dropped


def _routing(seed: int, num_tokens: int, top_k: int, num_experts: int, ties: bool, skew: bool = True):
    """Distinct experts per token (like a real top-k); skewed so that some experts overflow; with
    ``ties`` the weights take only a few values so that equal weights compete for the same expert."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.linspace(3.0, 0.2, num_experts) if skew else torch.ones(num_experts)
    indices = torch.stack(
        [torch.multinomial(popularity, top_k, replacement=False, generator=gen) for _ in range(num_tokens)]
    )
    if ties:
        weights = torch.randint(1, 4, (num_tokens, top_k), generator=gen).float() / 8
    else:
        weights = torch.rand(num_tokens, top_k, generator=gen)
    return indices, weights


CONFIGS = [  # (tokens, top_k, experts)
    (16, 2, 4),
    (23, 3, 8),
    (40, 4, 16),
    (7, 1, 4),
]


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_apply_capacity_matches_reference(policy: str, factor: float, ties: bool) -> None:
    total_dropped = tied_drops = 0
    for seed in range(4):
        for num_tokens, top_k, num_experts in CONFIGS:
            indices, weights = _routing(seed, num_tokens, top_k, num_experts, ties)
            got = apply_capacity(indices, weights, num_experts, factor, policy=policy)
            ref_idx, ref_w, ref_dropped = reference_capacity(
                indices.tolist(), weights.tolist(), num_experts, factor, policy
            )
            ctx = f"seed={seed} T={num_tokens} K={top_k} E={num_experts} factor={factor} policy={policy}"
            assert got.indices.tolist() == ref_idx, ctx
            assert got.weights.tolist() == ref_w, ctx
            assert got.dropped.tolist() == ref_dropped, ctx
            assert got.indices.dtype == indices.dtype and got.weights.dtype == weights.dtype
            assert got.dropped.dtype == torch.int64 and got.dropped.shape == (num_experts,)
            total_dropped += sum(ref_dropped)
            # a dropped slot whose weight equals a kept slot's weight on the same expert: a tie decided
            for t, k in (got.indices == num_experts).nonzero().tolist():
                e, w = int(indices[t, k]), float(weights[t, k])
                tied_drops += bool(((got.indices == e) & (weights == w)).any())
    assert total_dropped > 0, "fixture drops nothing"
    if ties:
        assert tied_drops > 0, "fixture has no tie at the capacity boundary"


def test_ties_go_to_the_earlier_slot() -> None:
    """Hand-made: expert 0 gets 4 slots of equal weight, capacity 2 -> the first two slots win."""
    indices = torch.tensor([[0, 1], [2, 0], [0, 3], [0, 1]])
    weights = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    assert expert_capacity(4, 2, 4, 1.0) == 2
    for policy in ("probs", "position"):
        got = apply_capacity(indices, weights, 4, 1.0, policy=policy)
        assert got.indices.tolist() == [[0, 1], [2, 0], [4, 3], [4, 1]], policy
        assert got.weights.tolist() == [[0.5, 0.5], [0.5, 0.5], [0.0, 0.5], [0.0, 0.5]], policy
        assert got.dropped.tolist() == [2, 0, 0, 0], policy


def test_probs_keeps_heaviest_position_keeps_earliest() -> None:
    indices = torch.tensor([[0], [0], [0], [1]])
    weights = torch.tensor([[0.1], [0.9], [0.5], [0.3]])
    # capacity ceil(0.5 * 4 * 1 / 2) = 1
    probs = apply_capacity(indices, weights, 2, 0.5, policy="probs")
    position = apply_capacity(indices, weights, 2, 0.5, policy="position")
    assert probs.indices.flatten().tolist() == [2, 0, 2, 1]
    assert position.indices.flatten().tolist() == [0, 2, 2, 1]
    assert probs.dropped.tolist() == position.dropped.tolist() == [2, 0]


def test_bf16_weights_and_no_drops() -> None:
    indices, weights = _routing(3, 32, 2, 8, ties=True)
    weights = weights.bfloat16()
    got = apply_capacity(indices, weights, 8, 0.5, policy="probs")
    ref_idx, ref_w, _ = reference_capacity(indices.tolist(), weights.float().tolist(), 8, 0.5, "probs")
    assert got.weights.dtype == torch.bfloat16
    assert got.indices.tolist() == ref_idx and got.weights.float().tolist() == ref_w
    # a factor large enough for every slot drops nothing
    big = apply_capacity(indices, weights, 8, 8.0)
    assert torch.equal(big.indices, indices) and torch.equal(big.weights, weights)
    assert big.dropped.sum().item() == 0


def test_unknown_policy_raises() -> None:
    indices, weights = _routing(0, 4, 2, 4, ties=False)
    with pytest.raises(ExpertParallelError, match="random"):
        apply_capacity(indices, weights, 4, 1.0, policy="random")


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_renormalize_kept(policy: str, factor: float) -> None:
    for seed in range(3):
        indices, weights = _routing(seed, 24, 3, 8, ties=seed == 2)
        weights = weights.requires_grad_(True)
        plain = apply_capacity(indices, weights, 8, factor, policy=policy)
        got = apply_capacity(indices, weights, 8, factor, policy=policy, renormalize=True)
        assert torch.equal(got.indices, plain.indices) and torch.equal(got.dropped, plain.dropped)
        kept = got.indices != 8
        assert torch.equal(got.weights[~kept], torch.zeros_like(got.weights[~kept]))
        total = weights.detach().sum(-1)
        plain_w = plain.weights.detach()
        for t in range(indices.shape[0]):
            if kept[t].any():
                expected = plain_w[t] * (total[t] / plain_w[t].sum())
                torch.testing.assert_close(got.weights[t].detach(), expected, rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(got.weights[t].detach().sum(), total[t], rtol=1e-6, atol=1e-7)
            else:
                assert got.weights[t].detach().abs().sum() == 0
        upstream = torch.randn(got.weights.shape, generator=torch.Generator().manual_seed(seed))
        (got.weights * upstream).sum().backward()
        assert weights.grad is not None and torch.isfinite(weights.grad).all()


def test_renormalize_token_with_every_slot_dropped() -> None:
    """Token 2 loses both slots: its weights are 0 (it passes through the residual), grads stay finite."""
    indices = torch.tensor([[0, 1], [0, 1], [0, 1], [2, 3]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.2, 0.1], [0.5, 0.5]], requires_grad=True)
    # capacity ceil(0.5 * 4 * 2 / 4) = 1 -> expert 0 keeps token 1, expert 1 keeps token 0
    got = apply_capacity(indices, weights, 4, 0.5, policy="probs", renormalize=True)
    assert got.indices.tolist() == [[4, 1], [0, 4], [4, 4], [2, 3]]
    torch.testing.assert_close(
        got.weights.detach(), torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.5, 0.5]])
    )
    got.weights.sum().backward()
    assert torch.isfinite(weights.grad).all()
    assert weights.grad[2].abs().sum() == 0


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "factor", "expected"),
    [
        (16, 2, 4, 1.0, 8),  # 32 slots over 4 experts
        (16, 2, 4, 1.25, 10),
        (16, 2, 4, 0.5, 4),
        (10, 2, 8, 1.25, 4),  # 3.125 -> 4
        (3, 1, 4, 0.5, 1),  # 0.375 -> 1
        (7, 3, 8, 1.0, 3),  # 2.625 -> 3
        (1, 1, 64, 1.0, 1),
        (0, 2, 8, 1.0, 0),
        (100, 8, 64, 1.5, 19),  # 18.75 -> 19
    ],
)
def test_expert_capacity_hand_computed(
    tokens: int, top_k: int, experts: int, factor: float, expected: int
) -> None:
    assert expert_capacity(tokens, top_k, experts, factor) == expected


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "factor", "expected"),
    [
        (50, 4, 4, 1.1, 55),
        (50, 8, 8, 1.1, 55),
        (25, 8, 4, 1.1, 55),
    ],
)
def test_expert_capacity_decimal_factor(
    tokens: int, top_k: int, experts: int, factor: float, expected: int
) -> None:
    assert expert_capacity(tokens, top_k, experts, factor) == expected


def test_renormalize_kept_slots_of_zero_weight_stay_finite() -> None:
    indices = torch.tensor([[0, 1], [2, 1]])
    weights = torch.tensor([[0.0, 0.5], [0.5, 0.9]])
    # capacity ceil(0.5 * 2 * 2 / 4) = 1: expert 1 keeps token 1's slot, token 0 keeps only its 0.0 slot
    got = apply_capacity(indices, weights, 4, 0.5, policy="probs", renormalize=True)
    assert got.indices.tolist() == [[0, 4], [2, 1]]
    assert torch.isfinite(got.weights).all()
    assert got.weights[0, 1].item() == 0.0  # a dropped slot holds weight 0
