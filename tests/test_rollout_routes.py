"""Rollout routing replay (R3) in one process: the inference engine's routes (vLLM's and SGLang's layout)
placed in a TRL-style padded batch and replayed in a checkpointed training forward, against the
unmodified model's own routers (the engine here) and against the unmodified model with its top-k fixed.
Through TRL's GRPOTrainer at EP 2: test_engines.py (``grpo_replay``)."""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import pytest
import torch

import hp_rewrite
from hp_rewrite import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.routing.replay import replay_disagreement
from hp_rewrite.tiny import build_tiny_model, tiny_config
from hp_rewrite.training.rollout import (
    Rollout,
    engine_layout,
    moe_layer_indices,
    rollout_routes,
    sglang_routed_experts,
)
from tests.test_routing import _forced_router, _grads, _worst_grad

PROMPTS, COMPLETIONS, PAD = [3, 5, 4], [4, 2, 3], 1  # tokens per row; TRL left-pads prompts, right-pads completions


def _models(family: str, tmp_path: Path):
    ref = build_tiny_model(tiny_config(family), seed=0).train()
    return ref, rewrite_model(copy.deepcopy(ref), parse_plan("version: 1\nep_size: 1\n"), artifact_dir=tmp_path)


def _batch(vocab: int):
    """``(input_ids, attention_mask, prompt width, [(prompt, completion)])`` as TRL's GRPOTrainer builds them."""
    gen = torch.Generator().manual_seed(4)
    width_p, width_c = max(PROMPTS), max(COMPLETIONS)
    ids = torch.full((len(PROMPTS), width_p + width_c), PAD)
    mask = torch.zeros_like(ids)
    seqs = []
    for b, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        prompt, completion = torch.randint(3, vocab, (p,), generator=gen), torch.randint(3, vocab, (c,), generator=gen)
        ids[b, width_p - p:width_p], ids[b, width_p:width_p + c] = prompt, completion
        mask[b, width_p - p:width_p + c] = 1
        seqs.append((prompt.tolist(), completion.tolist()))
    return ids, mask, width_p, seqs


def _engine_routes(ref, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """What vLLM returns for each row, built from the unmodified Qwen3-MoE's own routers (hooks on its
    ``mlp.gate``, whose third output is the chosen experts): ``[N - 1, num_hidden_layers, top_k]``."""
    chosen, hooks = {}, []
    for i, layer in enumerate(ref.model.layers):
        hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out[2])))
    with torch.no_grad():
        ref(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    rows, width = ids.shape
    out = []
    for b in range(rows):
        real = mask[b].nonzero().flatten()
        start, n = int(real[0]), real.numel()
        out.append(torch.stack([chosen[i].reshape(rows, width, -1)[b, start:start + n - 1]
                                for i in range(len(ref.model.layers))], dim=1).to(torch.int32))
    return out


def test_engine_layout_is_what_the_unmodified_routers_choose(tmp_path: Path) -> None:
    """The rewritten model's recorded routing, in the engines' layout, is the unmodified model's routing
    (the engine's), row for row; SGLang's base64 form decodes to the same; back in the batch it replays."""
    ref, model = _models("qwen3_moe", tmp_path)
    ids, mask, width_p, seqs = _batch(ref.config.vocab_size)
    with hp_rewrite.record_routing(model) as routes, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    engine = _engine_routes(ref, ids, mask)
    ours = engine_layout(model, routes, mask)
    assert [list(t.shape) for t in ours] == [[p + c - 1, 2, 2] for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(ours, engine, strict=True))
    for t in engine:
        meta = {"routed_experts": base64.b64encode(t.numpy().tobytes()).decode()}
        assert torch.equal(sglang_routed_experts(meta, model), t)
    rollouts = [Rollout(p, c, r) for (p, c), r in zip(seqs, engine, strict=True)]
    back = rollout_routes(model, rollouts, ids, width_p)
    for name, calls in back.layers.items():
        got, recorded = calls[0].long(), routes.layers[name][0].long()
        real = torch.cat([torch.arange(int(m.nonzero()[0]), int(m.nonzero()[-1])) + b * ids.shape[1]
                          for b, m in enumerate(mask)])  # every real token but the last
        assert torch.equal(got[real], recorded[real]), name
        assert int((got[:, 0] >= 0).sum()) == real.numel() and bool((got[got[:, 0] < 0] == -1).all())


def test_dense_layers_keep_their_columns(tmp_path: Path) -> None:
    """DeepSeek-V3's first layer is dense: the engines' column 0 is zero and the MoE layer is column 1."""
    _, model = _models("deepseek_v3", tmp_path)
    assert list(moe_layer_indices(model).values()) == [1]
    ids, mask, width_p, seqs = _batch(model.config.vocab_size)
    with hp_rewrite.record_routing(model) as routes, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    engine = engine_layout(model, routes, mask)
    assert all(bool((t[:, 0] == 0).all()) for t in engine)
    back = rollout_routes(model, [Rollout(p, c, r) for (p, c), r in zip(seqs, engine, strict=True)], ids, width_p)
    name = next(iter(routes.layers))
    kept = back.layers[name][0][:, 0] >= 0
    assert torch.equal(back.layers[name][0][kept].long(), routes.layers[name][0][kept].long())


@pytest.mark.parametrize("reentrant", [False, True])
def test_rollout_replayed_in_a_checkpointed_training_forward(reentrant: bool, tmp_path: Path) -> None:
    """The engine's routes (the unmodified routers before the policy moved), replayed in training forwards
    of two rows then one (TRL's chunks) with activation checkpointing: every token the engine forwarded
    goes to its experts, the others (padding, the last token) where the moved routers send them; the
    gradients equal the unmodified model's with that top-k fixed; the disagreement is counted."""
    ref, model = _models("qwen3_moe", tmp_path)
    ids, mask, width_p, seqs = _batch(ref.config.vocab_size)
    engine = _engine_routes(ref, ids, mask)
    with torch.no_grad():  # the policy moves: left alone, the routers would choose differently
        for m in (ref, model):
            for name, p in m.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    with hp_rewrite.record_routing(model) as moved, torch.no_grad():
        for s in (slice(0, 2), slice(2, 3)):
            model(input_ids=ids[s], attention_mask=mask[s])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    labels = ids.masked_fill(mask == 0, -100)
    routes = rollout_routes(model, [Rollout(p, c, r) for (p, c), r in zip(seqs, engine, strict=True)], ids, width_p,
                            batch_size=2)
    with hp_rewrite.replay_routing(model, routes), hp_rewrite.record_routing(model) as used:
        for s in (slice(0, 2), slice(2, 3)):
            model(input_ids=ids[s], attention_mask=mask[s], labels=labels[s]).loss.backward()
    replayed, disagreed = (int(t) for t in replay_disagreement(model))
    assert replay_disagreement(model) is None  # read once
    recorded = sum(int((c[:, 0] >= 0).sum()) for calls in routes.layers.values() for c in calls)
    assert replayed == recorded == 2 * sum(p + c - 1 for p, c in zip(PROMPTS, COMPLETIONS, strict=True))
    assert 0 < disagreed < replayed  # the moved routers would have chosen otherwise for some tokens
    for name in routes.layers:
        for want, free, got in zip(routes.layers[name], moved.layers[name], used.layers[name], strict=True):
            kept = want[:, 0] >= 0
            assert torch.equal(got[kept].long(), want[kept].long()), name
            assert torch.equal(got[~kept].long(), free[~kept].long()), name
    for i, layer in enumerate(ref.model.layers):
        calls = iter(used.layers[f"model.layers.{i}.mlp.experts"])
        router = layer.mlp.gate
        router.forward = lambda hidden, router=router, calls=calls: _forced_router(router, next(calls).long())(hidden)
    for s in (slice(0, 2), slice(2, 3)):
        ref(input_ids=ids[s], attention_mask=mask[s], labels=labels[s]).loss.backward()
    assert _worst_grad(_grads(model), _grads(ref)) <= 1e-5


def test_rollouts_that_are_not_the_batch_refused(tmp_path: Path) -> None:
    ref, model = _models("qwen3_moe", tmp_path)
    ids, mask, width_p, seqs = _batch(ref.config.vocab_size)
    engine = _engine_routes(ref, ids, mask)
    rollouts = [Rollout(p, c, r) for (p, c), r in zip(seqs, engine, strict=True)]
    with pytest.raises(ExpertParallelError, match="row 0 of the training batch is not the sequence"):
        rollout_routes(model, rollouts[::-1], ids, width_p)
    with pytest.raises(ExpertParallelError, match=r"routes are \[6, 2, 2\], where the engines give \[5, 2, 2\]"):
        rollout_routes(model, [Rollout(seqs[0][0], seqs[0][1][:-1], engine[0])] + rollouts[1:], ids[:, :-1], width_p)
    wrong = engine[0].clone()
    wrong[0, 0, 0] = 8
    with pytest.raises(ExpertParallelError, match="outside 0..7"):
        rollout_routes(model, [Rollout(*seqs[0], wrong)] + rollouts[1:], ids, width_p)
