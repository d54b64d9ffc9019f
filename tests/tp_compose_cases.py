"""A TP x EP model (tp 2 x dp 2, sequence parallel) inside what users run around it: a hand-written loop
with ``sync_gradients`` and ``clip_grad_norm_``, activation checkpointing, ``torch.compile``,
``fully_shard`` (2-D: data parallel x tp), DCP checkpoints, ``save_pretrained`` read back by plain
transformers, ``load_state_dict`` of a full checkpoint, and ``generate``."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hp_rewrite
from hp_rewrite.errors import UserError
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import parse_plan
from tests.tp_cases import PER_BATCH, SEQ, full, lm_loss, reference

MAX_NORM = 0.05  # below the gradients' norm: clipping scales every gradient


def _plan(ep: int, sp: bool = True):
    return parse_plan(f"version: 1\nep_size: {ep}\ntp_size: 2\nsequence_parallel: {'true' if sp else 'false'}\n")


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)


def _worst_param(model, ref) -> float:
    """Largest parameter difference after training, relative to the parameter's largest value."""
    from hp_rewrite.runtime.binding.install import expert_weights, local_rows

    weights = expert_weights(model)
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        target = ref_params[name].detach()
        if name in weights:
            target = local_rows(*weights[name], target)
        worst = max(worst, ((full(p.detach()) - target).abs().max() / target.abs().max().clamp_min(1e-12)).item())
    return worst


def _train(model, ref, batches, rank: int, step_fn=None, forward=None) -> tuple[float, list[float]]:
    """Two AdamW steps with clipping on the TP model (its TP group's batch) and on the unmodified model
    (the concatenated batch); the worst parameter difference and the TP model's reported norms."""
    opt, ref_opt, norms = _optimizer(model), _optimizer(ref), []
    dp_rank = rank // 2
    for ids in batches:
        mine = ids[dp_rank * PER_BATCH:(dp_rank + 1) * PER_BATCH]
        lm_loss(ref(input_ids=ids).logits, ids).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        (step_fn or _plain_step)(model, mine, model if forward is None else forward)
        norms.append(abs(hp_rewrite.clip_grad_norm_(model, MAX_NORM).item() - ref_norm.item()) / ref_norm.item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return _worst_param(model, ref), norms


def _plain_step(model, ids, forward=None) -> None:
    lm_loss((model if forward is None else forward)(input_ids=ids).logits, ids).backward()
    hp_rewrite.sync_gradients(model)


def _fsdp_step(model, ids, forward=None) -> None:
    lm_loss(model(input_ids=ids).logits, ids).backward()  # FSDP2 reduces during backward


def compose(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    out_dir = Path(payload["out_dir"])
    art = out_dir / "art"
    base = reference("qwen3_moe")
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, base.config.vocab_size, (PER_BATCH * world // 2, SEQ), generator=gen)
               for _ in range(2)]
    result = {}

    # a hand-written loop; the same with activation checkpointing
    for name, checkpointing in (("loop", False), ("checkpointing", True)):
        ref, model = copy.deepcopy(base), rewrite_model(copy.deepcopy(base), _plan(4), artifact_dir=art)
        calls = []
        if checkpointing:
            model.activation_checkpointing_enable()
            model.config.use_cache = False
            model.model.layers[0].mlp.register_forward_pre_hook(lambda *a, seen=calls: seen.append(1))
        result[name] = _train(model, ref, batches, rank)
        if checkpointing:  # each step ran the MoE block twice: forward, and again in backward
            result["recomputed"] = len(calls) == 2 * len(batches)

    # torch.compile of the whole model
    ref, model = copy.deepcopy(base), rewrite_model(copy.deepcopy(base), _plan(2), artifact_dir=art)
    torch._dynamo.utils.counters.clear()
    # aot_eager: dynamo and AOTAutograd trace what inductor would compile, at a fraction of the time on 4 ranks
    # sharing 2 cores (test_engines compiles a whole model with inductor)
    result["compile"] = _train(model, ref, batches[:1], rank, forward=torch.compile(model, backend="aot_eager"))
    result["compiled_frames"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    # FSDP2 over data parallel x tp
    ref, model = copy.deepcopy(base), rewrite_model(copy.deepcopy(base), _plan(2), artifact_dir=art)
    hp_rewrite.fully_shard(model)
    from torch.distributed.fsdp import FSDPModule

    q = model.model.layers[0].self_attn.q_proj.weight  # FSDP2 over dp, DTensor TP within: a 2-D DTensor
    result["fsdp_2d"] = (isinstance(model, FSDPModule) and isinstance(q, DTensor)
                         and tuple(q.device_mesh.mesh_dim_names) == ("dp", "tp"))
    result["fsdp"] = _train(model, ref, batches, rank, step_fn=_fsdp_step)

    # DCP: save after a step, load into a fresh TP model (and one at another EP size), same logits
    model = rewrite_model(copy.deepcopy(base), _plan(2), artifact_dir=art)
    opt = _optimizer(model)
    _plain_step(model, batches[0][rank // 2 * PER_BATCH:(rank // 2 + 1) * PER_BATCH])
    opt.step()
    hp_rewrite.save_checkpoint(model, opt, out_dir / "dcp")
    probe = batches[1][:PER_BATCH]
    with torch.no_grad():
        expected = model(input_ids=probe).logits
    for ep in (2, 4):
        again = rewrite_model(copy.deepcopy(base), _plan(ep), artifact_dir=art)
        opt2 = _optimizer(again)
        _plain_step(again, probe)  # creates the optimizer state DCP loads into
        opt2.step()
        opt2.zero_grad()
        hp_rewrite.load_checkpoint(again, opt2, out_dir / "dcp")
        with torch.no_grad():
            result[f"dcp_ep{ep}"] = (again(input_ids=probe).logits - expected).abs().max().item()

    # save_pretrained: plain transformers reads it back and computes the same logits
    hp_rewrite.save_pretrained(model, out_dir / "saved")
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(out_dir / "saved")
    with torch.no_grad():
        result["saved"] = (plain(input_ids=probe).logits - expected).abs().max().item()
    # from_pretrained under a TP plan: only this rank's experts read, the dense parts split after
    loaded = hp_rewrite.from_pretrained(out_dir / "saved", plan=_plan(2), artifact_dir=art)
    with torch.no_grad():
        result["from_pretrained"] = (loaded(input_ids=probe).logits - expected).abs().max().item()
    result["from_pretrained_split"] = loaded.hp_rewrite.tensor is not None and any(
        isinstance(p, DTensor) for p in loaded.parameters())
    try:
        hp_rewrite.load_fully_sharded(out_dir / "saved", plan=_plan(2), artifact_dir=art)
        result["load_fully_sharded"] = ""
    except UserError as e:
        result["load_fully_sharded"] = str(e)
    # a full checkpoint into a TP model by load_state_dict: every rank keeps its shards
    fresh = rewrite_model(copy.deepcopy(base), _plan(2), artifact_dir=art)
    fresh.load_state_dict(plain.state_dict())
    with torch.no_grad():
        result["load_state_dict"] = (fresh(input_ids=probe).logits - expected).abs().max().item()
    dist.barrier()

    # generate (tensor parallel, no sequence parallelism): the unmodified model's greedy tokens
    model = rewrite_model(copy.deepcopy(base).eval(), _plan(2, sp=False), artifact_dir=art)
    prompt = batches[0][:1, :5]
    want = base.eval().generate(prompt, max_new_tokens=6, do_sample=False)
    got = model.generate(prompt, max_new_tokens=6, do_sample=False)
    result["generate"] = bool(torch.equal(want, got))
    # with sequence parallelism: the prompt (4 tokens) sequence-sharded, the decode steps replicated
    sp_model = rewrite_model(copy.deepcopy(base).eval(), _plan(2), artifact_dir=art)
    prompt = batches[0][:1, :4]
    result["generate_sp"] = bool(torch.equal(base.generate(prompt, max_new_tokens=6, do_sample=False),
                                             sp_model.generate(prompt, max_new_tokens=6, do_sample=False)))
    try:  # training on a sequence the group cannot split is still refused
        sp_model.train()(input_ids=batches[0][:1, :5])
        result["odd_training"] = ""
    except UserError as e:
        result["odd_training"] = str(e)
    return result
