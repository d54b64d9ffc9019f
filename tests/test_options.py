"""Configuration errors name the value at fault and what to choose instead."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_rewrite.runtime.compute.experts import ExpertsLayout
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.group.groups import ExpertParallelGroup, ExpertPlacement, build_expert_parallel_group
from hp_rewrite.runtime.options import RuntimeOptions


def test_defaults_are_valid() -> None:
    opts = RuntimeOptions()
    assert opts.as_dict() == {
        "compute": "auto",
        "chunks": 1,
        "overlap": True,
        "capacity_factor": None,
        "drop_policy": "probs",
        "renormalize_kept": False,
        "dedup": True,
        "defer_expert_grads": False,
        "dequant_chunk_mb": 64.0,
        "fp8_gemm": False,
        "balance": "off",
        "balance_threshold": 1.1,
        "balance_min_rows": 1024,
        "balance_replicas": 2,
    }
    RuntimeOptions(
        compute="eager", chunks=4, capacity_factor=1.25, drop_policy="position", renormalize_kept=True
    )


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"compute": "fast"}, ["compute", "'fast'", "auto", "grouped", "eager"]),
        ({"chunks": 0}, ["chunks=0", ">= 1"]),
        ({"chunks": True}, ["chunks=True", ">= 1"]),
        ({"chunks": 1.5}, ["chunks=1.5", ">= 1"]),
        ({"capacity_factor": 0}, ["capacity_factor=0", "> 0", "null"]),
        ({"capacity_factor": -1.0}, ["capacity_factor=-1.0", "> 0"]),
        ({"drop_policy": "random"}, ["drop_policy", "'random'", "probs", "position"]),
        ({"dedup": 1}, ["dedup=1", "true or false"]),
        ({"defer_expert_grads": "yes"}, ["defer_expert_grads='yes'", "true or false"]),
    ],
    ids=["compute", "chunks0", "chunks_bool", "chunks_float", "capacity0", "capacity_neg", "drop_policy", "dedup",
         "defer_expert_grads"],
)
def test_runtime_options_validation(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ExpertParallelError) as info:
        RuntimeOptions(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        RuntimeOptions(chunks=0)


def test_placement_not_divisible() -> None:
    with pytest.raises(ExpertParallelError) as info:
        ExpertPlacement(num_experts=6, ep_size=4, ep_rank=0)
    message = str(info.value)
    assert "6" in message and "ep_size=4" in message
    assert "[1, 2, 3, 6]" in message


def test_placement_bad_rank_and_no_experts() -> None:
    with pytest.raises(ExpertParallelError, match="ep_rank=4"):
        ExpertPlacement(num_experts=8, ep_size=4, ep_rank=4)
    with pytest.raises(ExpertParallelError, match="num_experts=0"):
        ExpertPlacement(num_experts=0, ep_size=1, ep_rank=0)


def test_placement_slices() -> None:
    p = ExpertPlacement(num_experts=8, ep_size=4, ep_rank=2)
    assert (p.num_local, p.local_experts, p.local_index) == (2, (4, 5), slice(4, 6))


@pytest.fixture
def no_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")


@pytest.mark.usefixtures("no_distributed")
def test_build_group_needs_torchrun() -> None:
    with pytest.raises(ExpertParallelError) as info:
        build_expert_parallel_group(2)
    assert "torchrun" in str(info.value) and "ep_size=2" in str(info.value)


@pytest.mark.usefixtures("no_distributed")
def test_build_group_single() -> None:
    group = build_expert_parallel_group(1)
    assert isinstance(group, ExpertParallelGroup)
    assert group.size == 1 and group.rank == 0 and group.group is None
    assert not group.is_distributed


@pytest.mark.parametrize("ep_size", [0, -1, True, 1.0])
def test_build_group_bad_size(ep_size) -> None:
    with pytest.raises(ExpertParallelError, match="ep_size"):
        build_expert_parallel_group(ep_size)


class NoExpertWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 4))  # no down_proj: not an experts holder


def test_experts_layout_without_weights() -> None:
    with pytest.raises(ExpertParallelError, match="NoExpertWeights"):
        ExpertsLayout.of(NoExpertWeights())
    with pytest.raises(ExpertParallelError, match="Linear"):
        ExpertsLayout.of(nn.Linear(4, 4))


def test_placement_order_is_checked() -> None:
    with pytest.raises(ExpertParallelError, match="not a permutation"):
        ExpertPlacement(4, 2, 0, order=(0, 1, 1, 3))
    with pytest.raises(ExpertParallelError, match="ascending"):
        ExpertPlacement(4, 2, 0, order=(1, 0, 2, 3))
    assert ExpertPlacement(4, 2, 1, order=(0, 1, 2, 3)) == ExpertPlacement(4, 2, 1)  # one spelling


def test_balanced_placement_evens_out_a_skewed_load() -> None:
    loads = [50, 40, 30, 5, 5, 4, 3, 1]  # contiguous at ep=2: 125 vs 13; best possible: 74 vs 64
    contiguous = ExpertPlacement(8, 2, 0)
    balanced = [ExpertPlacement.balanced(loads, 2, r) for r in range(2)]
    assert contiguous.rank_loads(loads) == [125.0, 13.0]
    assert balanced[0].order == balanced[1].order  # every rank computes the same placement
    assert sorted(balanced[0].rank_loads(loads)) == [64.0, 74.0]
    owned = sorted(e for p in balanced for e in p.local_experts)
    assert owned == list(range(8)) and all(len(p.local_experts) == 4 for p in balanced)
    slots = balanced[1].slot_of_expert
    assert [balanced[1].order[slots[e]] for e in range(8)] == list(range(8))
    assert balanced[1].local_index == list(balanced[1].local_experts)
    # uniform loads keep the contiguous placement
    assert ExpertPlacement.balanced([1] * 8, 4, 3) == ExpertPlacement(8, 4, 3)


def test_balanced_placement_is_near_the_best_split() -> None:
    """Against brute force over every split of 8 experts in 2 ranks: never worse than 5% above it."""
    rng = random.Random(0)
    for _ in range(50):
        loads = [rng.randint(0, 100) ** 2 for _ in range(8)]
        best = min(
            max(sum(loads[e] for e in half), sum(loads) - sum(loads[e] for e in half))
            for half in itertools.combinations(range(8), 4)
        )
        got = max(ExpertPlacement.balanced(loads, 2, 0).rank_loads(loads))
        assert best <= got <= 1.05 * best
        assert got <= max(ExpertPlacement(8, 2, 0).rank_loads(loads))
