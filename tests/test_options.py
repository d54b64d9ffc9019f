"""Configuration errors name the value at fault and what to choose instead."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_rewrite.runtime import (
    ExpertParallelError,
    ExpertParallelGroup,
    ExpertPlacement,
    ExpertsLayout,
    RuntimeOptions,
    build_expert_parallel_group,
)


def test_defaults_are_valid() -> None:
    opts = RuntimeOptions()
    assert opts.as_dict() == {
        "compute": "auto",
        "chunks": 1,
        "overlap": True,
        "capacity_factor": None,
        "drop_policy": "probs",
        "renormalize_kept": False,
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
    ],
    ids=["compute", "chunks0", "chunks_bool", "chunks_float", "capacity0", "capacity_neg", "drop_policy"],
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
    assert (p.num_local, p.first_local, p.local_slice) == (2, 4, slice(4, 6))


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
