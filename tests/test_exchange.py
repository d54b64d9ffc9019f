"""The one exchange interface, in one process: the per-slot and deduplicated exchanges are chosen once
per layer, comm.py is given the turn hook and the gradient queue instead of reaching for them, and the
frozen EP group holds no queue. Numerics of both exchanges over real ranks: test_ep_parity.py."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hp_rewrite.runtime.group.groups import ExpertParallelGroup, ExpertPlacement
from hp_rewrite.runtime.options import RuntimeOptions
from hp_rewrite.runtime.overlap.context import ExchangeRuntime
from hp_rewrite.runtime.overlap.deferred import WeightGradQueue
from hp_rewrite.runtime.pipeline.layer import ExpertParallelBinding
from hp_rewrite.runtime.transport import comm
from hp_rewrite.runtime.transport.exchange import (
    DEDUP,
    NPU_PER_SLOT,
    PER_SLOT,
    DedupExchange,
    PerSlotExchange,
    TokenExchange,
    exchange_for,
)

RUNTIME = Path(__file__).resolve().parents[1] / "hp_rewrite" / "runtime"


def test_the_exchange_is_chosen_once_per_layer() -> None:
    assert exchange_for(True, 2) is DEDUP and exchange_for(False, 2) is PER_SLOT
    assert exchange_for(True, 1) is PER_SLOT  # nothing to deduplicate on one rank
    # the NPU permute ops replace the per-slot exchange's permutations only; dedup has none to give them
    assert exchange_for(False, 2, npu_ops=True) is NPU_PER_SLOT and exchange_for(True, 1, npu_ops=True) is NPU_PER_SLOT
    assert exchange_for(True, 2, npu_ops=True) is DEDUP
    assert isinstance(DEDUP, DedupExchange) and isinstance(NPU_PER_SLOT, PerSlotExchange)
    for impl in (PER_SLOT, DEDUP, NPU_PER_SLOT):  # each implements every step of the protocol
        missing = [n for n in TokenExchange.__dict__ if not n.startswith("_") and not hasattr(impl, n)]
        assert not missing, (type(impl).__name__, missing)


def test_dispatch_and_combine_have_no_exchange_branches() -> None:
    tree = ast.parse((RUNTIME / "pipeline" / "dispatch.py").read_text())
    tests = [ast.unparse(n.test) for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp))]
    assert not [t for t in tests if "dedup" in t or "sent" in t], tests


def test_comm_reaches_neither_the_scheduler_nor_the_queue() -> None:
    tree = ast.parse((RUNTIME / "transport" / "comm.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"turns", "deferred", "give_turn", "WeightGradQueue"}, imported


def test_the_group_holds_no_queue() -> None:
    """The frozen group carries no mutable state; a binding's runtime is its model's (shared by copies)."""
    ep = ExpertParallelGroup(size=2)
    assert "weight_grads" not in {f.name for f in dataclasses.fields(ep)} and not hasattr(ep, "weight_grads")
    binding = ExpertParallelBinding(ep, ExpertPlacement(4, 2, 0), RuntimeOptions())
    assert copy.deepcopy(binding).runtime is binding.runtime  # a model copy shares its runtime
    other = ExpertParallelBinding(ep, ExpertPlacement(4, 2, 0), RuntimeOptions())
    assert other.runtime is not binding.runtime  # a holder installed on its own gets its own
    own = ExchangeRuntime()
    assert ExpertParallelBinding(ep, ExpertPlacement(4, 2, 0), RuntimeOptions(), own).runtime is own


def test_no_module_keeps_runtime_state() -> None:
    import hp_rewrite.runtime.overlap.context as context

    assert not [n for n, v in vars(context).items() if isinstance(v, (dict, list, set)) and not n.startswith("__")]


def test_hooks_follow_the_options() -> None:
    rt = ExchangeRuntime()
    defer = RuntimeOptions(defer_expert_grads=True)
    assert rt.hooks(defer, 2).filler is rt.weight_grads and rt.queue_for(defer, 2) is rt.weight_grads
    for opts, size in ((defer, 1), (RuntimeOptions(defer_expert_grads=True, overlap=False), 2), (RuntimeOptions(), 2)):
        assert rt.hooks(opts, size).filler is None and rt.queue_for(opts, size) is None
        assert rt.hooks(opts, size).turn is rt.turn


@pytest.fixture
def world_of_one(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [True, False], ids=["async", "sync"])
def test_exchanges_call_the_hooks_they_are_given(world_of_one, overlap: bool) -> None:
    turns: list[str] = []
    queue = WeightGradQueue()
    hooks = comm.WaitHooks(lambda: turns.append("turn"), queue)
    x = torch.randn(3, 4, requires_grad=True)
    counts = comm.exchange_counts(torch.tensor([[2, 1]]), world_of_one, hooks)
    assert counts.tolist() == [[2, 1]] and turns == ["turn"]
    pending = comm.exchange(x, [3], [3], world_of_one, overlap, hooks)
    y = pending.wait()
    assert torch.equal(y, x) and len(turns) == 2
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and len(turns) == 3
    turns.clear()
    comm.exchange(x, [3], [3], world_of_one, overlap).wait()  # no hooks given: nothing called
    assert turns == []
