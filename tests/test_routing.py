"""Routing health and control (plan ``routing:``) in one process: the counts taken in the forward
against a hand count of the unmodified model's routers. The engines' logs of them, at EP 2 on 2 and 4
ranks, are tested in test_engines.py and test_fsdp_engines.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import hp_rewrite
from hp_rewrite import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import ExpertParallelError, expert_capacity
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests.training_cases import count_routing


def _models(tmp_path: Path, routing: str = "", runtime: str = ""):
    ref = build_tiny_model(tiny_config("qwen3_moe"), seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: 1\n{routing}{runtime}")
    return ref, rewrite_model(copy.deepcopy(ref), plan, artifact_dir=tmp_path)


def _ids(model, rows: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (rows, 8), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("reentrant", [False, True])
def test_counted_once_per_training_forward(reentrant: bool, tmp_path: Path) -> None:
    """Two training forwards with activation checkpointing (recomputed in backward: not counted again)
    and one without gradients (not counted) give the hand count of the two; reading starts afresh."""
    ref, model = _models(tmp_path)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    counts, _ = count_routing(ref)
    with torch.no_grad():
        for seed in (0, 1):
            ref(input_ids=_ids(ref, seed=seed))
    for seed in (0, 1):
        model(input_ids=_ids(model, seed=seed)).logits.sum().backward()
    with torch.no_grad():
        model(input_ids=_ids(model, seed=2))
    stats = hp_rewrite.routing_stats(model)
    assert [list(layer.tokens_per_expert) for layer in stats.layers] == [counts[i].tolist() for i in sorted(counts)]
    assert [layer.index for layer in stats.layers] == sorted(counts)
    assert [layer.name for layer in stats.layers] == [f"model.layers.{i}.mlp.experts" for i in sorted(counts)]
    want = [c.max().item() * c.numel() / c.sum().item() for c in (counts[i] for i in sorted(counts))]
    logs = stats.logs()
    assert logs["moe/imbalance"] == pytest.approx(max(want))
    assert logs["moe/dead_experts"] == sum((c == 0).sum().item() for c in counts.values())
    assert hp_rewrite.routing_stats(model).layers[0].tokens_per_expert == (0,) * 8  # read: starts afresh


def test_capacity_drops_counted(tmp_path: Path) -> None:
    """With a capacity, the chosen slots are still the router's and the drops each expert's excess."""
    ref, model = _models(tmp_path, runtime="runtime: {capacity_factor: 0.5}\n")
    counts, _ = count_routing(ref)
    ids = _ids(ref, rows=4)
    with torch.no_grad():
        ref(input_ids=ids)
    model(input_ids=ids).logits.sum().backward()
    stats = hp_rewrite.routing_stats(model)
    cap = expert_capacity(ids.numel(), 2, 8, 0.5)
    for layer in stats.layers:
        chosen = counts[layer.index].tolist()
        assert list(layer.tokens_per_expert) == chosen
        assert list(layer.dropped_per_expert) == [max(0, c - cap) for c in chosen]
    dropped = sum(max(0, c - cap) for i in counts for c in counts[i].tolist())
    assert stats.dropped_fraction == pytest.approx(dropped / sum(c.sum().item() for c in counts.values()))
    assert stats.dropped_fraction > 0


def test_compiled_forward_counts_as_eager(tmp_path: Path) -> None:
    """torch.compile(fullgraph=True) at EP 1 keeps one graph and counts what the eager model counts."""
    _, model = _models(tmp_path)
    eager = copy.deepcopy(model)
    ids = _ids(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(input_ids=ids).logits.sum().backward()
    eager(input_ids=ids).logits.sum().backward()
    got, want = hp_rewrite.routing_stats(model), hp_rewrite.routing_stats(eager)
    assert [layer.tokens_per_expert for layer in got.layers] == [layer.tokens_per_expert for layer in want.layers]
    assert sum(sum(layer.tokens_per_expert) for layer in got.layers) == 2 * ids.numel() * 2  # 2 layers, top-2
    assert all(layer.bytes_sent == 0 for layer in got.layers)  # host values: not counted while compiled


def test_stats_off(tmp_path: Path) -> None:
    _, model = _models(tmp_path, routing="routing: {stats: false}\n")
    assert all(getattr(m, "hp_routing_load", None) is None for m in model.modules())
    with pytest.raises(ExpertParallelError, match=r"routing\.stats: false"):
        hp_rewrite.routing_stats(model)
