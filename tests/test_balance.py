"""runtime.balance without a world: the decision (which rows move where), its knobs and its refusals.

The parity worlds (tests/test_ep_parity.py, "-balanced" cases; tests/test_rewrite.py, whole models)
check that balanced layers compute what the unmodified ones do; here the decision itself is checked
on made-up counts, every rank's part of it computed in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime.balance.decide import assign, moves
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.options import RuntimeOptions

FORCED = RuntimeOptions(balance="auto", balance_threshold=1.0, balance_min_rows=1)


def _after(per_slot: torch.Tensor, moved: torch.Tensor, ep: int) -> torch.Tensor:
    """Rows per rank once ``moved`` rows went from their experts' owners to the helpers."""
    return per_slot.view(ep, -1).sum(1) - moved.sum(1).view(ep, -1).sum(1) + moved.sum(0)


def test_a_hot_expert_is_spread_over_every_idle_rank() -> None:
    """EP 4, top-1: expert 0 alone takes more than a rank's share; its rows go to the three idle ranks."""
    per_slot = torch.tensor([400, 20, 20, 20, 20, 20, 20, 20])  # 2 experts per rank
    moved = moves(per_slot, 4, FORCED)
    assert moved[0].tolist() == [0, 95, 95, 95] and int(moved[1:].sum()) == 0
    assert _after(per_slot, moved, 4).tolist() == [135, 135, 135, 135]


def test_nothing_moves_under_the_threshold_or_below_the_fewest_rows() -> None:
    per_slot = torch.tensor([60, 50, 45, 45])  # max/mean 1.1
    assert int(moves(per_slot, 2, RuntimeOptions(balance="auto", balance_threshold=1.2,
                                                   balance_min_rows=1)).sum()) == 0
    assert int(moves(per_slot, 2, RuntimeOptions(balance="auto", balance_threshold=1.0,
                                                   balance_min_rows=11)).sum()) == 0
    moved = moves(per_slot, 2, FORCED)
    assert moved[0].tolist() == [0, 10] and _after(per_slot, moved, 2).tolist() == [100, 100]


def test_the_busiest_rank_gives_first_to_the_idlest_and_a_helper_takes_few_experts() -> None:
    per_slot = torch.tensor([5, 5, 40, 40, 1, 1, 30, 30])  # loads 10, 80, 2, 60: mean 38
    moved = moves(per_slot, 4, FORCED)
    by_helper = moved.sum(0).tolist()
    assert by_helper[1] == by_helper[3] == 0 and by_helper[2] > 0  # only the idle ranks take
    assert moved[2:4, 2].sum() > 0  # rank 1 (busiest) gives to rank 2 (idlest) first
    one = moves(per_slot, 4, RuntimeOptions(balance="auto", balance_threshold=1.0, balance_min_rows=1,
                                              balance_replicas=1))
    assert ((one > 0).sum(0) <= 1).all()



@pytest.mark.parametrize("ep", [2, 4])
def test_every_row_goes_to_its_expert_or_to_a_copy_of_it(ep: int) -> None:
    """Each rank's part of the decision, computed from the same gathered counts: the rows each helper
    gets for a guest slot are exactly the moved ones, all of one expert, and everything else goes home."""
    num_local, top_k = 2, 2
    g = torch.Generator().manual_seed(ep)
    experts = ep * num_local
    slots = [torch.multinomial(torch.tensor([8.0] + [1.0] * (experts - 1)), 20 * top_k, replacement=True,
                               generator=g).view(20, top_k) for _ in range(ep)]
    slots[0][0, 1] = experts  # a dropped slot stays dropped
    counts = torch.stack([torch.bincount(s.reshape(-1), minlength=experts + 1)[:experts] for s in slots])
    moved = moves(counts.sum(0), ep, FORCED)
    decisions = [assign(slots[r], counts, r, FORCED) for r in range(ep)]
    width = decisions[0].width
    guest_of = {}  # (helper, guest slot) -> expert
    received = torch.zeros(ep, width, dtype=torch.int64)
    for r, d in enumerate(decisions):
        for s, v in zip(slots[r].reshape(-1).tolist(), d.slots.reshape(-1).tolist(), strict=True):
            if s == experts:
                assert v == ep * width
                continue
            dest, local = divmod(v, width)
            received[dest, local] += 1
            if local < num_local:
                assert dest * num_local + local == s  # home: the expert's own slot
            else:
                assert guest_of.setdefault((dest, local), s) == s  # one expert per guest slot
    for (dest, _local), s in guest_of.items():
        assert moved[s, dest] > 0
    assert int(received[:, num_local:].sum()) == int(moved.sum()) > 0
    for r, d in enumerate(decisions):  # what each rank sends and receives agrees
        assert d.recvs.sum() == sum(1 for (dest, _), _s in guest_of.items() if dest == r)
        assert int(d.moved) == len(guest_of)
        lent = d.send_local[: int(d.sends.sum())].tolist()
        assert sorted(lent) == sorted(s % num_local for (_, _), s in guest_of.items() if s // num_local == r)


def test_options_and_plan_validate_the_balance_knobs() -> None:
    for bad in ({"balance": "on"}, {"balance_threshold": 0.9}, {"balance_min_rows": 0}, {"balance_replicas": 0}):
        with pytest.raises(ExpertParallelError, match=next(iter(bad))):
            RuntimeOptions(**bad)
    plan = parse_plan("version: 1\nep_size: 2\nruntime:\n  balance: auto\n  balance_min_rows: 256\n")
    assert plan.runtime.to_options().balance_min_rows == 256
    assert plan.hash() != parse_plan("version: 1\nep_size: 2\nruntime:\n  balance: auto\n").hash()
    assert parse_plan("version: 1\nep_size: 2\n").runtime.to_options().balance == "off"  # transformers' behaviour
    # a bare `off` is YAML's false: read as the choice the docs and error messages name
    assert parse_plan("version: 1\nep_size: 2\nruntime: {balance: off}\n").runtime.balance == "off"
    assert parse_plan("version: 1\nep_size: 2\nruntime:\n  balance: off\n").runtime.balance == "off"
    assert parse_plan("version: 1\nep_size: 2\ntp_size: 2\nruntime:\n  balance: auto\n").tp_size == 2  # composes
    assert parse_plan("version: 1\nep_size: 2\nruntime:\n  balance: auto\nrouting:\n  replay_rollout: true\n")


def test_the_cost_model_says_when_balancing_pays(capsys) -> None:
    """The break-even rows of a copy, and the forecast for Qwen3-30B-A3B's experts on an H100 node: a
    1.5x skew at EP 8 pays, an even batch moves nothing, and EP 64's small deficits stay home."""
    from hp_rewrite.cli import main
    from hp_rewrite.cost.balance import break_even_rows, forecast
    from hp_rewrite.cost.hardware import PRESETS

    h100 = PRESETS["h100-nvlink"]
    assert break_even_rows(h100, 2) == pytest.approx(2 * 989e12 * 0.6 / (3 * 450e9))
    expert = dict(num_experts=128, rows_per_rank=4096 * 8, matmul_params=3 * 2048 * 768, weight_bytes=2, hw=h100)
    skewed = forecast(ep=8, skew=1.5, **expert)
    assert skewed.pays and skewed.lent > 0 and skewed.balanced_skew < 1.1 and skewed.ratio < 0.9, skewed
    even = forecast(ep=8, skew=1.0, **expert)
    assert not even.pays and even.lent == 0 and even.ratio == 1.0
    assert forecast(ep=64, skew=1.5, **{**expert, "rows_per_rank": 2048 * 8}).lent == 0
    # a frozen expert with LoRA (A factor values, in the weight's bf16 as PEFT hands them over) kept as FP8 codes
    # (~1 byte a value): it sends its codes and factors, gets back only the factors' gradient, and a row saves
    # the forward and the input gradient (tools/measure_lent_bytes.py measures the runtime's bytes)
    params, factors = expert["matmul_params"], 16 * (2 * 2048 + 3 * 768)
    kept = forecast(ep=8, skew=1.5, **{**expert, "weight_bytes": 1.0}, lora_params=factors).copy
    assert (kept.sent_bytes, kept.returned_bytes) == (params + 2 * factors, 2 * factors), kept
    assert kept.row_flops == 4 * params + 6 * factors
    assert skewed.copy.sent_bytes == skewed.copy.returned_bytes == 2 * params  # trained, bf16: weights and gradient
    assert kept.break_even_rows(h100) < 0.5 * skewed.copy.break_even_rows(h100)
    config = Path(__file__).parent / "configs" / "qwen3_30b_a3b"
    plan = Path(__file__).parent.parent / "plans" / "grpo-qwen3-30b-a3b.yaml"
    assert main(["cost", str(plan), str(config), "--seq-len", "4096", "--micro-batch", "1", "--ep", "8",
                 "--hardware", "h100-nvlink", "--balance-skew", "1.5"]) == 0
    assert "balancing pays" in capsys.readouterr().out.replace("\n", " ")
    assert main(["cost", str(plan), str(config), "--seq-len", "4096", "--micro-batch", "1", "--ep", "8",
                 "--balance-skew", "9"]) == 2
    assert "--balance-skew" in capsys.readouterr().out
