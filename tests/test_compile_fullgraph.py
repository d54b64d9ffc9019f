"""torch.compile(fullgraph=True) of a rewritten model at EP=1 (#25 item 6): nothing is exchanged, so
no host value is needed and the whole model traces as one graph, forward and backward, in training
and in eval mode, against the unmodified model (dropless) or the eager rewritten model (capacity
drops: the unmodified model has none).

aot_eager keeps the test fast (dynamo and AOTAutograd trace the same graph inductor would compile);
test_engines runs inductor on the whole model (one graph)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from hp_rewrite import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.tiny import build_tiny_model, tiny_config

TOL = 1e-5  # fp32, relative to the largest entry
# LongCat's router gradient: its zero experts are summed as (sum_k w) * x, transformers adds each w * x
# (zero_experts.py): 1.5e-5 in eager mode as compiled, on a gradient whose entries are ~1e-6
LOOSER = {"longcat_flash": 3e-5}

CASES = {
    # block-level generated forward, grouped GEMMs with host-free offsets
    "qwen3_moe": ("qwen3_moe", "", "aot_eager"),
    # sigmoid group router, shared experts
    "deepseek_v3": ("deepseek_v3", "", "aot_eager"),
    # expert biases (per-row bias lookup from the device offsets)
    "gpt_oss": ("gpt_oss", "", "aot_eager"),
    # experts-level holder (expert_parallel_forward), flat weights, [B, S, H] in and out
    "dbrx": ("dbrx", "", "aot_eager"),
    # zero (identity) experts: sentinel slots as zeroed rows
    "longcat_flash": ("longcat_flash", "", "aot_eager"),
    # capacity drops: sentinel slots, against the eager rewritten model
    "mixtral-capacity": ("mixtral", "runtime: {capacity_factor: 1.1}\n", "aot_eager"),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("case", list(CASES))
def test_fullgraph_at_ep1_matches(case: str, tmp_path: Path) -> None:
    family, runtime, backend = CASES[case]
    torch.manual_seed(0)
    ref = build_tiny_model(tiny_config(family), seed=0)
    plan = parse_plan(f"version: 1\nep_size: 1\n{runtime}")
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=tmp_path)
    if runtime:  # the unmodified model drops nothing: compare with the same rewrite run eagerly
        ref = rewrite_model(ref, plan, artifact_dir=tmp_path)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    vocab = ref.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(3)
    for mode in ("train", "eval"):
        ref.train(mode == "train")
        model.train(mode == "train")
        ids = torch.randint(0, vocab, (2, 8), generator=gen)
        expected, got = ref(input_ids=ids).logits, compiled(input_ids=ids).logits
        assert _rel(expected, got) <= TOL, (mode, _rel(expected, got))
        (expected.float().square().mean()).backward()
        (got.float().square().mean()).backward()
        for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            if p.grad is None:
                assert q.grad is None or not q.grad.any(), name
                continue
            assert q.grad is not None, (mode, name)
            assert _rel(p.grad, q.grad) <= LOOSER.get(case, TOL), (mode, name, _rel(p.grad, q.grad))
        ref.zero_grad()
        model.zero_grad()
    # the whole model was one graph: a second trace with explain shows no break
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
