"""Routing health and control (plan ``routing:``) in one process: the counts taken in the forward
against a hand count of the unmodified model's routers. The engines' logs of them, at EP 2 on 2 and 4
ranks, are tested in test_engines.py and test_fsdp_engines.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import hp_rewrite
from hp_rewrite import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.pipeline.capacity import expert_capacity
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
    assert all(installed.routing_load(m) is None for m in model.modules())
    with pytest.raises(ExpertParallelError, match=r"routing\.stats: false"):
        hp_rewrite.routing_stats(model)


def _deepseek(tmp_path: Path, routing: str, **config):
    cfg = tiny_config("deepseek_v3")
    for key, value in config.items():
        setattr(cfg, key, value)
    ref = build_tiny_model(cfg, seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: 1\n{routing}")
    return ref, rewrite_model(copy.deepcopy(ref), plan, artifact_dir=tmp_path)


def _biases(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def test_selection_bias_updated_after_each_step_as_by_hand(tmp_path: Path) -> None:
    """routing.bias_update_rate in a loop (track_routing): after every optimizer step of two micro-batches
    each bias moved by rate * sign(mean load - load) of that step, exactly as a hand update of the
    unmodified model; the gradients are untouched (the parameters follow the unmodified model's)."""
    rate = 0.01
    ref, model = _deepseek(tmp_path, f"routing: {{bias_update_rate: {rate}}}\n")
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    hp_rewrite.track_routing(model, opt)
    counts, _ = count_routing(ref)
    start = _biases(ref)
    for step in range(3):
        counts.clear()
        for micro in range(2):
            ids = _ids(ref, seed=10 * step + micro)
            for m in (ref, model):
                m(input_ids=ids, labels=ids).loss.backward()
        opt_ref.step()
        opt.step()
        for layer, chosen in counts.items():  # the hand update of the unmodified model
            bias = ref.get_buffer(f"model.layers.{layer}.mlp.gate.e_score_correction_bias")
            load = chosen.float()
            bias.add_(torch.sign(load.mean() - load), alpha=rate)
        for m in (ref, model):
            m.zero_grad()
    got, want = _biases(model), _biases(ref)
    assert got.keys() == want.keys() and got
    assert all(torch.equal(got[n], want[n]) for n in want), (got, want)
    assert all(not torch.equal(want[n], start[n]) for n in want)  # they moved
    worst = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(),
                                                                           strict=True))
    assert worst <= 1e-5


def test_selection_bias_update_refused_without_a_step_or_a_bias(tmp_path: Path) -> None:
    _, model = _deepseek(tmp_path, "routing: {bias_update_rate: 0.001}\n")
    ids = _ids(model)
    with torch.no_grad():
        model(input_ids=ids)  # evaluation needs no step
    with pytest.raises(ExpertParallelError, match=r"hp_rewrite\.track_routing\(model, optimizer\)"):
        model(input_ids=ids).logits.sum().backward()
    with pytest.raises(ExpertParallelError, match=r"routing\.bias_update_rate: the router of model\.layers\.0\.mlp "
                                                  r"\(Qwen3MoeSparseMoeBlock\) has no selection bias"):
        _models(tmp_path / "qwen", routing="routing: {bias_update_rate: 0.001}\n")


def test_frozen_router_gets_no_gradient(tmp_path: Path) -> None:
    """routing.freeze_router: the routers train nothing (no gradient, so no optimizer state), and every
    other gradient is the unmodified model's with its routers frozen the same way."""
    ref, model = _deepseek(tmp_path, "routing: {freeze_router: true}\n")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"model.layers.1.mlp.gate.weight"}, frozen
    ref.get_parameter("model.layers.1.mlp.gate.weight").requires_grad_(False)
    ids = _ids(ref)
    for m in (ref, model):
        m(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in model.named_parameters():
        assert (p.grad is None) == (grads[n] is None), n
        if p.grad is not None:
            assert torch.allclose(p.grad, grads[n], rtol=1e-5, atol=1e-7), n
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    assert model.get_parameter("model.layers.1.mlp.gate.weight") not in opt.state


def test_frozen_router_with_an_adapter_on_it_refused(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    _, model = _models(tmp_path, routing="routing: {freeze_router: true}\n")
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["gate"]))
    trainer = Trainer(model=peft, args=TrainingArguments(output_dir=str(tmp_path / "t"), use_cpu=True, report_to=[]))
    with pytest.raises(ExpertParallelError, match=r"routing\.freeze_router is set, but router parameters train: "
                                                  r".*mlp\.gate\.modules_to_save"):
        hp_rewrite.prepare_trainer(trainer)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst_grad(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)).item() for n in want)


def _bias_moved_in_recompute(model) -> None:
    """Every router's selection bias shifted while activation checkpointing recomputes (inside backward):
    the recomputed router would choose other experts than its forward did (the weights, from the
    unbiased scores, are unchanged)."""
    def shift(module, args):
        if torch._C._current_graph_task_id() != -1:
            module.hp_saved_bias = module.e_score_correction_bias.clone()
            module.e_score_correction_bias.add_(torch.linspace(-1, 1, module.e_score_correction_bias.numel()))

    def restore(module, args, out):
        if getattr(module, "hp_saved_bias", None) is not None:
            module.e_score_correction_bias.copy_(module.hp_saved_bias)
            module.hp_saved_bias = None

    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):
            m.register_forward_pre_hook(shift)
            m.register_forward_hook(restore)


@pytest.mark.parametrize(("reentrant", "groups"), [(False, 2), (True, 2), (False, 1)])
def test_recompute_replays_the_forward_s_routing(reentrant: bool, groups: int, tmp_path: Path) -> None:
    """A recomputation that would choose other experts (its selection bias shifted in backward) replays the
    forward's choice: the gradients are the unmodified model's without checkpointing; with
    routing.replay_in_recompute: false the same recomputation gives other gradients (or fails). With one
    expert group (GLM-4.5, Kimi-K2) the group's top-2 over all experts is not mistaken for the routing."""
    ids = _ids(build_tiny_model(tiny_config("deepseek_v3"), seed=0), rows=4)
    results = {}
    for replay in (True, False):
        ref, model = _deepseek(tmp_path / str(replay), f"routing: {{replay_in_recompute: {str(replay).lower()}}}\n",
                               n_group=groups, topk_group=1)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        _bias_moved_in_recompute(model)
        ref(input_ids=ids, labels=ids).loss.backward()
        try:
            model(input_ids=ids, labels=ids).loss.backward()
            results[replay] = _worst_grad(_grads(model), _grads(ref))
        except torch.utils.checkpoint.CheckpointError:
            results[replay] = float("inf")  # torch noticed the recomputation differ
    assert results[True] <= 1e-5, results
    assert results[False] > 1e-2, results  # the shifted bias did change the recomputed routing


def _forced_router(router, indices: torch.Tensor):
    """The unmodified Qwen3-MoE router with its top-k fixed to ``indices``: softmax of the current
    logits, the weights gathered at the given experts, renormalised as the model does."""
    def forward(hidden):
        logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights = probs.gather(1, indices)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(probs.dtype), indices
    return forward


def test_recorded_routing_replayed_in_training(tmp_path: Path) -> None:
    """record_routing around a rollout forward (no gradients), the routers then moved (as a policy update
    moves them), the routes saved and loaded: the training forward under replay_routing (with activation
    checkpointing) sends every token to the recorded experts, and its gradients equal those of the
    unmodified model with the same top-k fixed in its routers."""
    ref, model = _models(tmp_path)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = _ids(ref, rows=4)
    with hp_rewrite.record_routing(model) as routes, torch.no_grad():
        model(input_ids=ids)
    routes.save(tmp_path / "routes.safetensors")
    loaded = hp_rewrite.Routes.load(tmp_path / "routes.safetensors")
    assert {n: [t.tolist() for t in c] for n, c in loaded.layers.items()} == \
        {n: [t.tolist() for t in c] for n, c in routes.layers.items()}
    with torch.no_grad():  # the policy moves: left alone, the routers would choose differently
        for m in (ref, model):
            for name, p in m.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    with torch.no_grad():
        fresh = {n: torch.bincount(c[0].long().reshape(-1), minlength=8) for n, c in routes.layers.items()}
        model(input_ids=ids)
        assert any(not torch.equal(installed.last_stats(m).tokens_per_expert, fresh[n]) for n, m in model.named_modules()
                   if n in fresh)
    with hp_rewrite.replay_routing(model, loaded):
        model(input_ids=ids, labels=ids).loss.backward()
    for name, m in model.named_modules():
        if name in fresh:
            assert torch.equal(installed.last_stats(m).tokens_per_expert, fresh[name]), name
    for name, m in ref.named_modules():
        if name.endswith("mlp.gate"):
            m.forward = _forced_router(m, routes.layers[name.replace("gate", "experts")][0].long())
    ref(input_ids=ids, labels=ids).loss.backward()
    assert _worst_grad(_grads(model), _grads(ref)) <= 1e-5


def test_replay_refusals(tmp_path: Path) -> None:
    _, model = _models(tmp_path)
    ids = _ids(model)
    with hp_rewrite.record_routing(model) as routes, torch.no_grad():
        model(input_ids=ids)
    with pytest.raises(ExpertParallelError, match="recorded forwards not replayed"):
        with hp_rewrite.replay_routing(model, routes):
            pass
    with pytest.raises(ExpertParallelError, match="runs more forwards than were recorded"):
        with hp_rewrite.replay_routing(model, routes), torch.no_grad():
            model(input_ids=ids)
            model(input_ids=ids)
    with pytest.raises(ExpertParallelError, match="did not choose its experts with torch.topk over 8 scores and k=2 "
                                                  "for 24 tokens"):
        with hp_rewrite.replay_routing(model, routes), torch.no_grad():
            model(input_ids=_ids(model, rows=2))  # 16 tokens: not what was recorded


def test_profile_draws_a_run_s_logged_routing(tmp_path: Path) -> None:
    """A prepared Trainer's routing log (one line per log, per-expert counts) becomes `hp-rewrite profile
    --routing-log`'s heatmap and JSON: every layer's counts summed over the run, which a balanced
    placement reads; a file that is not a routing log is a user error."""
    from transformers import Trainer, TrainingArguments

    from hp_rewrite.cli import main
    from hp_rewrite.plan import load_plan

    _, model = _models(tmp_path)
    samples = [{"input_ids": row, "labels": row.clone()} for row in _ids(model, rows=8, seed=4)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=3,
                             logging_steps=1, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = hp_rewrite.prepare_trainer(Trainer(model=model, args=args, train_dataset=samples))
    trainer.train()
    log = tmp_path / "run" / "hp_rewrite_routing.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 3 and all(line["steps"] == 1 for line in lines)
    assert all(layer["tokens"] == 16 and sum(layer["tokens_per_expert"]) == 32 for line in lines
               for layer in line["layers"])
    assert main(["profile", "--routing-log", str(log), "--ep", "2", "--out", str(tmp_path / "prof")]) == 0
    data = json.loads((tmp_path / "prof" / "profile.json").read_text())
    assert (tmp_path / "prof" / "profile.png").stat().st_size > 1000
    assert data["num_tokens"] == 48 and data["top_k"] == 2 and data["ep"] == 2
    for i, layer in enumerate(data["layers"]):
        assert layer["path"] == f"model.layers.{i}.mlp"
        assert layer["tokens_per_expert"] == [sum(c) for c in zip(*(line["layers"][i]["tokens_per_expert"]
                                                                     for line in lines), strict=True)]
    plan = tmp_path / "balanced.yaml"
    plan.write_text(f"version: 1\nep_size: 2\nplacement: {{strategy: balanced, profile: {tmp_path / 'prof'}/profile.json}}\n")
    assert set(load_plan(plan).placement.loads) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert main(["profile", "--routing-log", str(tmp_path / "bad.jsonl")]) == 2
    assert main(["profile", "--routing-log", str(log), str(plan)]) == 2


def test_routers_without_a_top_k_recompute_afresh(tmp_path: Path) -> None:
    """PhiMoE's sparsemixer chooses without torch.topk: under activation checkpointing the default replay
    steps aside for it, with a warning, and the gradients are the unmodified model's (same random draws)."""
    ref = build_tiny_model(tiny_config("phimoe"), seed=0).train()
    model = rewrite_model(copy.deepcopy(ref), parse_plan("version: 1\nep_size: 1\n"), artifact_dir=tmp_path)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = _ids(ref)
    torch.manual_seed(0)  # the sparsemixer samples in training
    with pytest.warns(UserWarning, match="does not choose its experts with torch.topk"):
        model(input_ids=ids, labels=ids).loss.backward()
    torch.manual_seed(0)
    ref(input_ids=ids, labels=ids).loss.backward()
    assert _worst_grad(_grads(model), _grads(ref)) <= 1e-5


def test_global_load_balancing_loss_refusals(tmp_path: Path) -> None:
    """routing.aux_loss: global on a model without transformers' loss, or trained without computing it."""
    with pytest.raises(ExpertParallelError, match=r"routing\.aux_loss: global: DeepseekV3ForCausalLM has no "
                                                  r"transformers load-balancing loss"):
        _deepseek(tmp_path / "ds", "routing: {aux_loss: global}\n")
    _, model = _models(tmp_path, routing="routing: {aux_loss: global}\n")  # output_router_logits off
    ids = _ids(model)
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # evaluation: transformers' loss (none here)
    with pytest.raises(ExpertParallelError, match="computed no load-balancing loss; load the model with "
                                                  "output_router_logits=True"):
        model(input_ids=ids, labels=ids)


@pytest.mark.parametrize("reentrant", [False, True])
def test_router_z_loss_on_the_micro_batch(reentrant: bool, tmp_path: Path) -> None:
    """routing.z_loss_coef with transformers' own load-balancing loss (micro_batch), under activation
    checkpointing, padded rows masked: the loss and every gradient are those of the unmodified model plus
    the z-loss computed by hand; with reentrant checkpointing (whose forward runs without gradients, so the
    z-loss would train nothing) the training forward is refused."""
    from tests.training_cases import z_loss_by_hand

    cfg = tiny_config("qwen3_moe")
    cfg.output_router_logits = True
    ref = build_tiny_model(cfg, seed=0).train()
    model = rewrite_model(copy.deepcopy(ref), parse_plan("version: 1\nep_size: 1\nrouting: {z_loss_coef: 0.01}\n"),
                          artifact_dir=tmp_path)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = _ids(ref, rows=3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if reentrant:
        with pytest.raises(ExpertParallelError, match="use_reentrant=False"):
            model(input_ids=ids, attention_mask=mask, labels=labels)
        return
    z = z_loss_by_hand(ref)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    (want.loss + 0.01 * z(mask)).backward()
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    got.loss.backward()
    assert got.aux_loss.item() == pytest.approx(want.aux_loss.item(), rel=1e-6)  # transformers' own, untouched
    assert _worst_grad(_grads(model), _grads(ref)) <= 1e-5


def test_z_loss_under_a_trainer_that_ignores_it_is_refused(tmp_path: Path) -> None:
    """TRL's SFTTrainer takes only the load-balancing term from the model: with that term off the z-loss
    would train nothing, so prepare_trainer refuses it."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tests.fsdp_engine_script import _tokenizer

    _, model = _models(tmp_path, routing="routing: {z_loss_coef: 0.01}\n")
    data = Dataset.from_dict({"input_ids": [row.tolist() for row in _ids(model, rows=4)]})
    args = SFTConfig(output_dir=str(tmp_path / "sft"), use_cpu=True, report_to=[], bf16=False, max_steps=1,
                     router_aux_loss_coef=0.0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer(128))
    with pytest.raises(ExpertParallelError, match=r"routing\.z_loss_coef: SFTTrainer computes its own loss"):
        hp_rewrite.prepare_trainer(trainer)
