"""Training engines around a rewritten model, run on every rank of a real gloo world: DDP as users
build it (``DistributedDataParallel(model)``), against the unmodified model stepped on the
concatenated batch of every rank; and the wrappers and calls that must be refused."""

from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hp_rewrite import routing_stats, sync_gradients
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.sync.gradients import expert_parameters
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests.training_cases import _lm_loss, _worst, count_routing


def lent_or_guests(model) -> int:
    """Experts this rank lent to or computed for others in the last forward, over every layer
    (runtime.balance: 0 when no row moved)."""
    stats = [installed.last_stats(h) for _, h in installed.holders(model)]
    return sum(st.guests + st.lent for st in stats if st is not None)


def lent_bytes(model) -> tuple[int, int]:
    """Bytes this rank's lent experts sent in the last forward, and their gradients' bytes coming back."""
    stats = [st for _, h in installed.holders(model) if (st := installed.last_stats(h)) is not None]
    return sum(st.lent_bytes for st in stats), sum(st.lent_grad_bytes for st in stats)


def _optimizer(name: str, params, lr: float):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, eps=1e-4, weight_decay=0.01)


def replicated_digest(model) -> str:
    """A hash of every replicated parameter's bytes: equal on every rank iff they are bit-identical."""
    experts = {id(p) for p in expert_parameters(model)}
    h = hashlib.sha256()
    for p in model.parameters():
        if id(p) not in experts:
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def ddp_training(rank: int, world: int, payload: dict) -> dict:
    """``steps`` optimizer steps of DDP(rewritten model), each over ``accum`` micro-batches per rank
    (the non-final ones inside ``no_sync()`` when asked), optionally clipped by the plain
    ``clip_grad_norm_``, against the unmodified model stepped on the whole batch of each step."""
    torch.set_num_threads(1)
    if payload.get("npu_standin"):  # the torch_npu stand-in on this rank's path only
        from tests.npu_cases import use_standin

        calls = use_standin().CALLS
    ref = build_tiny_model(tiny_config(payload.get("model_type", "qwen3_moe")), seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: {payload['ep_size']}\n{payload.get('plan', '')}")
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    if payload.get("checkpointing"):  # activation checkpointing, as Trainer turns it on
        for m in (ref, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loop = payload.get("engine") == "loop"  # the hand-written loop: hp_rewrite.sync_gradients, no DDP
    ddp = model if loop else DDP(model, find_unused_parameters=payload.get("find_unused", False))
    name, lr, max_norm = payload.get("optimizer", "sgd"), payload.get("lr", 1.0), payload.get("max_norm")
    opt_ref, opt = _optimizer(name, ref.parameters(), lr), _optimizer(name, model.parameters(), lr)
    accum, per_rank, seq = payload.get("accum", 1), 2, 8
    vocab = ref.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(7)
    out = {"grad_worst": 0.0, "norms": [], "ref_norms": [], "digests": [], "guests": 0}  # guests: runtime.balance
    for step in range(payload.get("steps", 1)):
        ids = torch.randint(0, vocab, (world * accum * per_rank, seq), generator=gen)
        if payload.get("routing_logs"):  # a hand count of the unmodified routers' choice on the global batch
            counts, handles = count_routing(ref)
            with torch.no_grad():
                ref(input_ids=ids)
            for handle in handles:
                handle.remove()
            out.setdefault("hand_routing", []).append([counts[i].tolist() for i in sorted(counts)])
        _lm_loss(ref(input_ids=ids).logits, ids).backward()
        micro = ids.view(accum, world, per_rank, seq)[:, rank]  # micro-batch i of this rank
        for i in range(accum):
            last = i == accum - 1
            ctx = ddp.no_sync() if payload.get("no_sync") and not last else torch.enable_grad()
            with ctx:
                (_lm_loss(ddp(input_ids=micro[i]).logits, micro[i]) / accum).backward()
            out["guests"] += sum(getattr(installed.last_stats(h), "guests", 0) for _, h in installed.holders(model))
            if loop and (last or payload.get("sync_each")):
                sync_gradients(model)
        if step == 0:
            out["grad_worst"], out["grad_worst_name"] = _worst(model, ref, lambda p: p.grad, floor_of=lambda ps: max(
                p.grad.abs().max().item() for p in ps if p.grad is not None) * 1e-3)
        if max_norm is not None:
            out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        digests = [None] * world
        dist.all_gather_object(digests, replicated_digest(model))
        out["digests"].append(digests)
    out["worst"], out["worst_name"] = _worst(model, ref, lambda p: p.detach())
    out["reductions"] = model.hp_rewrite.engine.reductions
    if payload.get("routing_logs"):  # a hand-written loop's read of the routing statistics
        out["routing_logs"] = routing_stats(model).logs()
    if payload.get("npu_standin"):
        out["npu_calls"] = dict(calls)
    return out


def expert_grad_norms(rank: int, world: int, payload: dict) -> dict:
    """The norms of an ExpertGrad are those of the whole tensor over the EP group; everything else
    about it is a plain local tensor."""
    from hp_rewrite.sync.gradnorm import mark_expert_grads

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    gen = torch.Generator().manual_seed(4)
    full = [torch.randn(world, 3, 5, generator=gen) for _ in range(2)]  # two parameters' full tensors
    params = [torch.nn.Parameter(f[rank].clone()) for f in full]
    for p, f in zip(params, full, strict=True):
        p.grad = f[rank].clone() * 2
    mark_expert_grads(params, group)
    plain = torch.nn.Parameter(torch.ones(4))
    plain.grad = torch.full((4,), 0.5)
    whole = [f * 2 for f in full]
    out = {"type": type(params[0].grad).__name__}
    out["vector_norm"] = [torch.linalg.vector_norm(p.grad).item() for p in params]
    out["expected"] = [torch.linalg.vector_norm(w).item() for w in whole]
    out["inf"] = torch.linalg.vector_norm(params[0].grad, float("inf")).item()
    out["expected_inf"] = whole[0].abs().max().item()
    out["p3"] = params[1].grad.norm(3).item()
    out["expected_p3"] = whole[1].norm(3).item()
    out["foreach"] = [n.item() for n in torch._foreach_norm([params[0].grad, plain.grad, params[1].grad])]
    # local: this rank's rows alone (a global reduction would be far off), to rounding
    out["per_row_is_local"] = torch.allclose(torch.linalg.vector_norm(params[0].grad, dim=1), whole[0][rank].norm(dim=1),
                                             rtol=1e-6, atol=0)
    out["sum_is_local"] = math.isclose(params[0].grad.sum().item(), whole[0][rank].sum().item(), rel_tol=1e-6)
    out["sum_type"] = type(params[0].grad * 1).__name__
    total = torch.nn.utils.clip_grad_norm_(params + [plain], 1.0).item()
    out["clip_total"] = total
    out["expected_total"] = torch.cat([w.reshape(-1) for w in whole] + [torch.full((4,), 0.5)]).norm().item()
    return out


def _error(fn) -> str:
    try:
        fn()
    except ExpertParallelError as e:
        return str(e)
    return ""


def ddp_refusals(rank: int, world: int, payload: dict) -> dict:
    """What DDP cannot do exactly with an expert-parallel model ends in a clear error on every rank."""
    torch.set_num_threads(1)
    ref = build_tiny_model(tiny_config("qwen3_moe"), seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    art = Path(payload["out_dir"])
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    out = {}

    # a DDP built before the rewrite still holds the replaced full expert weights
    early = DDP(copy.deepcopy(ref))
    rewrite_model(early.module, plan, artifact_dir=art)
    out["built_before"] = _error(lambda: early(input_ids=ids))
    out["rewrite_wrapped"] = _error(lambda: rewrite_model(DDP(copy.deepcopy(ref)), plan, artifact_dir=art))

    # a DDP told to manage the experts (the ignore list replaced) broadcast rank 0's experts
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=art)
    model._ddp_params_and_buffers_to_ignore = []
    out["manages_experts"] = _error(lambda: DDP(model)(input_ids=ids))

    # manual synchronisation on top of DDP would reduce every gradient twice
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=art)
    ddp = DDP(model)
    _lm_loss(ddp(input_ids=ids).logits, ids).backward()
    out["sync_twice"] = _error(lambda: sync_gradients(model))

    # the Interleaver runs two backward passes of one rank at once: DDP cannot
    from hp_rewrite import Interleaver

    def step():
        _lm_loss(ddp(input_ids=ids).logits, ids).backward()

    with Interleaver() as il:
        out["interleaver"] = _error(lambda: il.run([step, step]))
    model.zero_grad()

    # FSDP2 over a decoder layer shards each rank's own experts as if they were one tensor
    from torch.distributed.fsdp import fully_shard

    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=art)
    fully_shard(model.model.layers[0])
    out["fsdp2"] = _error(lambda: model(input_ids=ids))

    # FSDP1 flattens the experts into its flat parameter
    from torch.distributed.fsdp import FullyShardedDataParallel

    for orig in (False, True):
        model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=art)
        fsdp1 = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig)
        out[f"fsdp1_orig{orig}"] = _error(lambda m=fsdp1: m(input_ids=ids))

    # DDP over part of the world: not the world the expert gradients are divided by
    alone = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates every group
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=art)
    out["subgroup"] = _error(lambda: DDP(model, process_group=alone[rank])(input_ids=ids))
    return out


def compile_parity(rank: int, world: int, payload: dict) -> dict:
    """torch.compile of a rewritten model against the same model in eager mode: logits and every
    gradient, two steps (the second runs the compiled graphs again, new routing), and where dynamo
    breaks the graph."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    ref = build_tiny_model(tiny_config(payload.get("model_type", "qwen3_moe")), seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    eager = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    compiled_model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    compiled = torch.compile(compiled_model, backend=payload.get("backend", "inductor"))
    vocab = ref.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(20 + rank)
    out = {"logits": 0.0, "grads": 0.0}
    for _ in range(2):
        ids = torch.randint(0, vocab, (2, 8), generator=gen)
        a, b = eager(input_ids=ids).logits, compiled(input_ids=ids).logits
        out["logits"] = max(out["logits"], ((a - b).abs().max() / a.abs().max()).item())
        _lm_loss(a, ids).backward()
        _lm_loss(b, ids).backward()
        for p, q in zip(eager.parameters(), compiled_model.parameters(), strict=True):
            err = ((p.grad - q.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
            out["grads"] = max(out["grads"], err)
        eager.zero_grad()
        compiled_model.zero_grad()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"])))(
        input_ids=torch.randint(0, vocab, (2, 8), generator=gen))
    out["graphs"], out["breaks"] = explained.graph_count, explained.graph_break_count
    # where: file and function (line numbers move with every edit), and the line's code
    out["break_sites"] = sorted({f"{Path(r.user_stack[-1].filename).name}:{r.user_stack[-1].name}"
                                 for r in explained.break_reasons if r.user_stack})
    out["break_lines"] = sorted({(r.user_stack[-1].line or "").strip() for r in explained.break_reasons if r.user_stack})
    out["layers"] = ref.config.get_text_config().num_hidden_layers
    # the local expert compute (gate/up GEMM, activation, down GEMM) of a layer is one region
    out["grouped_mm_per_graph"] = [n for n in (sum("grouped_mm" in str(node.target) for node in g.graph.nodes)
                                               for g in explained.graphs) if n]
    return out


def peft_parity(rank: int, world: int, payload: dict) -> dict:
    """PEFT LoRA inside DDP: on attention (``target_modules``) or on the fused experts
    (``target_parameters``: each rank trains its own experts' adapters), against the unmodified model
    with the same adapters on the whole batch; one SGD step; for the experts, merge_and_unload and save."""
    from peft import LoraConfig, get_peft_model

    from hp_rewrite import save_pretrained
    from tests.peft_cases import copy_local_adapters, expert_slicers

    torch.set_num_threads(1)
    ref = build_tiny_model(tiny_config("qwen3_moe"), seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    if payload["target"] == "attention":
        config = dict(target_modules=["q_proj", "v_proj"])
    else:
        # with attention too: DDP refuses a model whose only trainable parameters it ignores
        config = dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    torch.manual_seed(3)
    peft_ref = get_peft_model(ref, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **config))
    torch.manual_seed(3)
    peft_ep = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **config))
    slicers = expert_slicers(peft_ep, peft_ref)
    ref_params = dict(peft_ref.named_parameters())
    copy_local_adapters(peft_ep, peft_ref, slicers)
    trainable = [n for n, p in peft_ep.named_parameters() if p.requires_grad]
    before = Path(payload["out_dir"]) / "adapter_before"  # plain PEFT's save of the adapters before the step
    if payload["target"] == "experts" and rank == 0:
        peft_ref.save_pretrained(before)
    ddp = DDP(peft_ep)
    vocab = ref.config.vocab_size
    ids = torch.randint(0, vocab, (2 * world, 8), generator=torch.Generator().manual_seed(9))
    mine = ids[2 * rank : 2 * rank + 2]
    _lm_loss(peft_ref(input_ids=ids).logits, ids).backward()
    _lm_loss(ddp(input_ids=mine).logits, mine).backward()

    def worst(get) -> tuple[float, str]:
        out = (0.0, "")
        for name, p in peft_ep.named_parameters():
            if name not in trainable:
                continue
            target = get(ref_params[name])
            target = slicers[name](target) if name in slicers else target
            out = max(out, (((get(p) - target).abs().max() / target.abs().max().clamp_min(1e-12)).item(), name))
        return out

    result = {"trainable": len(trainable), "rank_local_adapters": len(slicers)}
    result["grad_worst"], result["grad_worst_name"] = worst(lambda p: p.grad)
    for m in (peft_ref, peft_ep):
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0).step()
    result["worst"], result["worst_name"] = worst(lambda p: p.detach())
    if payload["target"] == "experts":  # the adapters saved and loaded as PEFT does; merged, saved, loaded
        from transformers import AutoModelForCausalLM

        from tests.peft_cases import adapter_round_trip

        result.update(adapter_round_trip(rank, peft_ref, peft_ep, plan, Path(payload["out_dir"]), mine, before,
                                         slicers))

        merged_ref, merged = peft_ref.merge_and_unload(), peft_ep.merge_and_unload()
        save_pretrained(merged, Path(payload["out_dir"]) / "merged")
        if rank == 0:
            plain = AutoModelForCausalLM.from_pretrained(Path(payload["out_dir"]) / "merged")
            target = dict(merged_ref.named_parameters())
            result["merged_worst"] = max(((p - target[n]).abs().max() / target[n].abs().max()).item()
                                         for n, p in plain.named_parameters())
    return result


def generate_parity(rank: int, world: int, payload: dict) -> dict:
    """Greedy generate() of the rewritten model gives the unmodified model's tokens (EP exchanges in
    every decoding step, each rank its own prompts)."""
    torch.set_num_threads(1)
    ref = build_tiny_model(tiny_config(payload.get("model_type", "qwen3_moe")), seed=0)
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    prompt = torch.randint(0, ref.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(30 + rank))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    twin = copy.deepcopy(model)  # a frozen reference / EMA copy: its own weights, the same EP group
    with torch.no_grad():
        a, b, c = ref.generate(prompt, **kwargs), model.generate(prompt, **kwargs), twin.generate(prompt, **kwargs)
    shared = any(p is q for p, q in zip(twin.parameters(), model.parameters(), strict=True))
    return {"equal": torch.equal(a, b), "twin_equal": torch.equal(a, c), "twin_shares_params": shared,
            "twin_guard_owns_twin": twin.hp_rewrite.engine._model is twin, "new_tokens": a.shape[1] - prompt.shape[1],
            **_ended_at_different_steps(rank, ref, model), **_lockstep_refusals(model)}


def _ended_at_different_steps(rank: int, ref, model) -> dict:
    """Rank 0's completion ends at its first token (EOS), the others' run to max_new_tokens, as EOS makes it
    in RL rollouts: generate in lockstep (the default, #46) gives each rank the unmodified model's tokens,
    greedy and sampling, with and without a cache, instead of a hang."""
    import torch.distributed as dist

    vocab, steps = ref.config.vocab_size, 8
    gen = torch.Generator().manual_seed(60 + rank)
    prompt = torch.randint(0, vocab, (1, 5), generator=gen)
    with torch.no_grad():
        first = ref.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1].item()
    eos = [first]
    dist.broadcast_object_list(eos, src=0)  # rank 0's first greedy token: EOS for every rank
    if rank:
        for _ in range(50):  # a prompt whose greedy completion never meets it
            with torch.no_grad():
                out = ref.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=eos[0])
            if out.shape[1] == prompt.shape[1] + steps and eos[0] not in out[0, prompt.shape[1]:].tolist():
                break
            prompt = torch.randint(0, vocab, (1, 5), generator=gen)
    result, lengths = {}, {}
    for name, kwargs in {"greedy": {"do_sample": False}, "greedy_no_cache": {"do_sample": False, "use_cache": False},
                         "sampling": {"do_sample": True, "top_k": 0}}.items():
        kwargs = dict(kwargs, max_new_tokens=steps, pad_token_id=0, eos_token_id=eos[0])
        outs = []
        for m in (ref, model):
            torch.manual_seed(7)
            with torch.no_grad():
                outs.append(m.generate(prompt, **kwargs))
        result[f"eos_{name}"] = torch.equal(*outs)
        lengths[name] = outs[0].shape[1] - prompt.shape[1]
    result["eos_lengths"] = lengths
    return result


def _lockstep_refusals(model) -> dict:
    """What would leave generate's loop early on one rank is refused by name."""
    from hp_rewrite.runtime.errors import ExpertParallelError

    out = {}
    for name, call in {"synced_false": lambda: model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=1,
                                                               synced_gpus=False),
                       "generate_batch": lambda: model.generate_batch([[1, 2, 3]])}.items():
        try:
            call()
            out[name] = "not refused"
        except ExpertParallelError as e:
            out[name] = str(e)
    return out
