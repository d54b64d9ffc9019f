"""One AdamW step of a rewritten model under EP x DP equals one step of the unmodified model on the
concatenated batch (run on every rank of a real gloo world)."""

from __future__ import annotations

import copy
import json
import re
import threading
from pathlib import Path

import pytest
import torch

import hp_rewrite
from hp_rewrite import auto_patch, sync_gradients
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.match import find_blocks
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.binding.install import expert_weights, local_rows
from hp_rewrite.sync.gradients import expert_parameters, rank_local_parameters
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests.host_traffic import LiveTemporaries

TOL = 1e-5


def _adamw(model):
    # eps above gradient rounding noise: Adam's first step is ~lr * g / (|g| + eps), ~lr * sign(g)
    # for |g| >> eps, so an element whose exact gradient is 0 (e.g. attention key biases, to which
    # softmax is invariant) would move by a full lr in the direction of its rounding noise. Real
    # gradients here are 1e-3..1, far above eps.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.01)


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def training_step(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    ref = build_tiny_model(tiny_config(payload["model_type"]), seed=0).train()
    text = f"version: 1\nep_size: {payload['ep_size']}\n"
    if payload.get("balanced"):  # experts spread over the ranks by a made-up skewed load
        loads = {s.path: [(e % 3) * 50 + e for e in range(s.num_experts)] for s in find_blocks(ref)}
        text += f"placement:\n  strategy: balanced\n  loads: {json.dumps(loads)}\n"
    text += payload.get("plan", "")
    plan = parse_plan(text)
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    per_rank, seq = 2, 8
    gen = torch.Generator().manual_seed(5)
    vocab = ref.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (per_rank * world, seq), generator=gen)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    kwargs = {"output_router_logits": True} if payload.get("aux") else {}

    # the language-model loss, mean over tokens: the mean of the per-rank means is the global mean.
    # (With output_router_logits the model would add its aux loss, a nonlinear function of the batch:
    # per-rank aux losses do not average to the global one, with or without hp-rewrite.)
    ref_out = ref(input_ids=ids, **kwargs)
    _lm_loss(ref_out.logits, ids).backward()
    weight_grads = model.hp_rewrite.runtime.weight_grads
    out = model(input_ids=ids[mine], **kwargs)
    _lm_loss(out.logits, ids[mine]).backward()
    placements = [installed.binding(m).placement for m in model.modules()
                  if installed.binding(m) is not None]
    result = {"local_experts": [p.num_local for p in placements],
              "contiguous": [p.is_contiguous for p in placements],
              # runtime.defer_expert_grads: weight-gradient jobs run (in exchange waits), none left queued
              "deferred_jobs": weight_grads.jobs_run, "deferred_in_waits": weight_grads.jobs_run_in_waits,
              "deferred_left": len(weight_grads)}
    if payload.get("aux"):
        # the aux loss of this rank's batch equals the unmodified model's aux loss on the same batch
        same_batch = copy.deepcopy(ref)(input_ids=ids[mine], **kwargs)
        result["aux_rel"] = (abs(out.aux_loss.item() - same_batch.aux_loss.item())
                             / max(abs(same_batch.aux_loss.item()), 1e-12))
    with LiveTemporaries() as temporaries:  # the reduction's own copies (plan: runtime.grad_bucket_mb)
        sync_gradients(model)
    with LiveTemporaries() as clip_temporaries:  # per-parameter norms only; a max_norm that scales by 1
        hp_rewrite.clip_grad_norm_(model.parameters(), 1e30)
    expert_ids = {id(p) for p in rank_local_parameters(model)}
    result.update(sync_peak=temporaries.peak, clip_peak=clip_temporaries.peak, bucket_bytes=int(plan.runtime.grad_bucket_mb * 2**20),
                  expert_grad_bytes=sum(p.grad.nbytes for p in model.parameters() if id(p) in expert_ids),
                  dense_grad_bytes=sum(p.grad.nbytes for p in model.parameters()
                                       if id(p) not in expert_ids and p.grad is not None))
    # Adam's first step is invariant to the gradient's scale, so the scale is checked on the
    # synchronised gradients themselves (a 2x expert gradient would pass the parameter check).
    grad_err, grad_name = _worst(model, ref, lambda p: p.grad, floor_of=lambda ps: max(
        p.grad.abs().max().item() for p in ps if p.grad is not None) * 1e-3)
    _adamw(ref).step()
    _adamw(model).step()
    worst, worst_name = _worst(model, ref, lambda p: p.detach())
    result.update(worst=worst, worst_name=worst_name, grad_worst=grad_err, grad_worst_name=grad_name)
    return result


def _worst(model, ref, get, floor_of=None) -> tuple[float, str]:
    weights = expert_weights(model)
    ref_params = dict(ref.named_parameters())
    floor = floor_of(ref_params.values()) if floor_of else 1e-12
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        value, target = get(p), get(ref_params[name])
        if name in weights:  # this rank's experts' rows of the reference (flat and zero-expert layouts too)
            target = local_rows(*weights[name], target)
        err = ((value - target).abs().max() / max(target.abs().max().item(), floor)).item()
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


def auto_patch_world(rank: int, world: int, payload: dict) -> dict:
    """auto_patch inside a real world: the loaded model is expert-parallel over the plan's EP group."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    plain = AutoModelForCausalLM.from_pretrained(payload["model_dir"], attn_implementation="eager")
    with auto_patch(plan, artifact_dir=Path(payload["out_dir"])):
        model = AutoModelForCausalLM.from_pretrained(payload["model_dir"], attn_implementation="eager")
    after = AutoModelForCausalLM.from_pretrained(payload["model_dir"], attn_implementation="eager")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        err = (model(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max().item()
    local = [installed.binding(m).placement.num_local for m in model.modules()
             if installed.binding(m) is not None]
    return {"err": err, "local": local, "after_patched": getattr(after, "hp_rewrite", None) is not None}


def overlapped_sync(rank: int, world: int, payload: dict) -> dict:
    """GradientSync (during backward, small buckets) gives the gradients sync_gradients gives after it,
    also over an accumulation of two micro-batches; a second backward without wait() is refused."""
    from hp_rewrite.sync.gradients import GradientSync

    torch.set_num_threads(1)
    ref = build_tiny_model(tiny_config(payload["model_type"]), seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: {payload['ep_size']}\n")
    after = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    # payload "plan": extra plan text for the overlapped model only (e.g. deferred expert gradients)
    plan = parse_plan(f"version: 1\nep_size: {payload['ep_size']}\n{payload.get('plan', '')}")
    during = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    sync = GradientSync(during, during.hp_rewrite.ep, bucket_bytes=4096)
    vocab = ref.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(10 + rank)
    micro = [torch.randint(0, vocab, (2, 8), generator=gen) for _ in range(2)]

    def loss(model, ids):
        return _lm_loss(model(input_ids=ids).logits, ids)

    worst, overlapped = 0.0, []
    for steps in (micro[:1], micro):  # one backward, then an accumulation of two
        for ids in steps:
            loss(after, ids).backward()
        sync_gradients(after)
        for i, ids in enumerate(steps):
            if i < len(steps) - 1:
                with sync.no_sync():
                    loss(during, ids).backward()
            else:
                loss(during, ids).backward()
        sync.wait()
        overlapped.append(sync.overlapped)
        for a, b in zip(after.parameters(), during.parameters(), strict=True):
            worst = max(worst, ((a.grad - b.grad).abs().max() / a.grad.abs().max().clamp_min(1e-12)).item())
        after.zero_grad(set_to_none=True)
        during.zero_grad(set_to_none=True)
    refused = ""
    try:
        loss(during, micro[0]).backward()
        loss(during, micro[1]).backward()
    except RuntimeError as e:
        refused = str(e)
    return {"worst": worst, "overlapped": overlapped, "buckets": len(sync.buckets), "refused": refused}


def interleaved_step(rank: int, world: int, payload: dict) -> dict:
    """Two micro-batches per rank run by a kept hp_rewrite.Interleaver (forward + backward each, taking
    turns at the exchanges; the second of two steps, on the kept thread, is checked) give the unmodified
    model's gradients on the concatenated batch, and the gradients of the same micro-batches run one
    after the other; the MoE blocks of the two micro-batches alternate."""
    from hp_rewrite import Interleaver

    torch.set_num_threads(1)
    ref = build_tiny_model(tiny_config(payload["model_type"]), seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: {payload['ep_size']}\n{payload.get('plan', '')}")
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    sequential = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    per_rank, seq = 4, 8
    vocab = ref.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (per_rank * world, seq), generator=torch.Generator().manual_seed(6))
    mine = ids[rank * per_rank : (rank + 1) * per_rank]
    micro = mine.chunk(2)
    _lm_loss(ref(input_ids=ids).logits, ids).backward()

    order: list[str] = []
    blocks = [m for m in model.modules() if installed.binding(m) is not None]
    for layer, blk in enumerate(blocks):
        blk.register_forward_pre_hook(lambda m, a, layer=layer: order.append((threading.current_thread().name, layer)))

    def step(m, batch, tag):
        loss = _lm_loss(m(input_ids=batch).logits, batch) / len(micro)
        loss.backward()
        return tag, loss.detach()

    with Interleaver() as il:  # two training steps on the same kept worker thread; the second is checked
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            order.clear()
            tags = [t for t, _ in il.run([lambda b=b, i=i: step(model, b, i) for i, b in enumerate(micro)])]
    for b in micro:
        step(sequential, b, None)
    sync_gradients(model)
    sync_gradients(sequential)
    grad_err, grad_name = _worst(model, ref, lambda p: p.grad, floor_of=lambda ps: max(
        p.grad.abs().max().item() for p in ps if p.grad is not None) * 1e-3)
    vs_sequential = max(((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-12)).item()
                        for a, b in zip(model.parameters(), sequential.parameters(), strict=True)
                        if b.grad is not None)
    return {"grad_worst": grad_err, "grad_worst_name": grad_name, "vs_sequential": vs_sequential,
            "tags": tags, "moe_calls": len(order), "blocks": len(blocks), "order": order}


def deferred_refusals(rank: int, world: int, payload: dict) -> dict:
    """runtime.defer_expert_grads turns the cases it cannot serve into clear errors: an expert weight with
    a gradient hook (it would never see the gradient) and a differentiable backward (create_graph)."""
    from hp_rewrite.runtime.errors import ExpertParallelError

    torch.set_num_threads(1)
    ref = build_tiny_model(tiny_config("qwen3_moe"), seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: {world}\nruntime:\n  defer_expert_grads: true\n")
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    out: dict[str, str] = {}
    hooked = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    expert_weight = expert_parameters(hooked)[0]
    expert_weight.register_post_accumulate_grad_hook(lambda p: None)
    try:
        hooked(input_ids=ids)
    except ExpertParallelError as e:
        out["hooked"] = str(e)
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]))
    loss = _lm_loss(model(input_ids=ids).logits, ids)
    try:
        loss.backward(create_graph=True)
    except ExpertParallelError as e:
        out["create_graph"] = str(e)
    model.hp_rewrite.runtime.weight_grads.clear()
    return out


def contract_world(rank: int, world: int, payload: dict) -> dict:
    """from_pretrained under auto_patch at EP=world: transformers' defaults (class, dtype, attention),
    this rank's experts only, and the unmodified model's logits (bf16)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    plain = AutoModelForCausalLM.from_pretrained(payload["model_dir"])
    with auto_patch(parse_plan(f"version: 1\nep_size: {world}\n"), artifact_dir=Path(payload["out_dir"])):
        model = AutoModelForCausalLM.from_pretrained(payload["model_dir"])
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        err = (model(input_ids=ids).logits.float() - plain(input_ids=ids).logits.float()).abs().max().item()
    holders = [m for m in model.modules() if installed.binding(m) is not None]
    return {"class": type(model).__name__, "dtype": str(model.dtype), "attn": model.config._attn_implementation,
            "local": [installed.binding(m).placement.num_local for m in holders],
            "experts": installed.binding(holders[0]).placement.num_experts, "err": err,
            "bytes_read": model.hp_rewrite.load_report["bytes_read"],
            "file_bytes": sum(f.stat().st_size for f in Path(payload["model_dir"]).glob("*.safetensors"))}


def contract_heads_world(rank: int, world: int, payload: dict) -> dict:
    """Every head class at EP=world from checkpoints saved by several classes: what plain transformers
    gives (class, loading info, every non-expert tensor, this rank's rows of every expert tensor, the
    output), only this rank's experts read; then save_pretrained of each, collective, into
    ``out_dir/saved/<class>-<source>`` (the test compares the files with plain transformers' save)."""
    import transformers

    from hp_rewrite import save_pretrained
    from hp_rewrite.hf import quiet_transformers

    torch.set_num_threads(1)
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    out = {"checked": [], "problems": []}
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))  # 1: no pad token set
    for cls_name, source, directory in payload["loads"]:
        cls = getattr(transformers, cls_name)
        with quiet_transformers():
            torch.manual_seed(0)  # weights the checkpoint lacks: drawn in the same order on both paths
            plain, plain_info = cls.from_pretrained(directory, output_loading_info=True)
            torch.manual_seed(0)
            with auto_patch(plan, artifact_dir=Path(payload["out_dir"]) / "art"):
                ours, ours_info = cls.from_pretrained(directory, output_loading_info=True)
        where = f"{cls_name} from {source}"
        if type(ours) is not cls or ours_info != plain_info:
            out["problems"].append(f"{where}: {type(ours).__name__}, {ours_info} vs {plain_info}")
        experts = expert_weights(ours)
        theirs = plain.state_dict()
        for name, t in ours.state_dict().items():  # what the checkpoint lacks too (drawn as plain: #44)
            want = local_rows(*experts[name], theirs[name]) if name in experts else theirs[name]
            if t.dtype != want.dtype or not torch.equal(t, want):
                out["problems"].append(f"{where}: {name}")
        with torch.no_grad():
            a, b = plain(input_ids=ids)[0].float(), ours(input_ids=ids)[0].float()
        if (a - b).abs().max().item() > 0.1:  # bf16
            out["problems"].append(f"{where}: output differs by {(a - b).abs().max().item()}")
        if ours.hp_rewrite.load_report["bytes_read"] >= sum(f.stat().st_size for f in Path(directory).glob("*.safetensors")):
            out["problems"].append(f"{where}: read every expert")
        save_pretrained(ours, Path(payload["out_dir"]) / "saved" / f"{cls_name}-{source}")
        out["checked"].append(where)
    a_file = Path(payload["out_dir"]) / "a_file"  # save_pretrained into a file: logged, skipped by every rank
    if rank == 0:
        a_file.write_text("kept")
    torch.distributed.barrier()
    if ours.save_pretrained(a_file) is not None or a_file.read_text() != "kept":
        out["problems"].append("save_pretrained into a file wrote or returned something")
    for cls_name, directory, kwargs in payload.get("mismatched", []):
        out["problems"] += _mismatched_sizes(getattr(transformers, cls_name), directory, kwargs, plan,
                                             Path(payload["out_dir"]) / "art")
        out["checked"].append(f"{cls_name} {sorted(kwargs)}")
    if payload.get("missing"):  # experts the checkpoint lacks, at EP 2 (#44)
        from tests.missing_experts_cases import missing_experts_world

        out["missing"] = missing_experts_world(rank, world, payload["missing"])
    if payload.get("weights"):  # checkpoint_weights at EP 2 (#46)
        from tests.weights_cases import checkpoint_weights_world

        out["weights"] = checkpoint_weights_world(rank, world, payload["weights"])
    return out


def _mismatched_sizes(cls, directory: str, kwargs: dict, plan, art: Path) -> list[str]:
    """from_pretrained(ignore_mismatched_sizes=True) at EP > 1: the tensors re-initialised as plain
    transformers does (values, this rank's rows of the expert tensors: #44; loading info with full shapes);
    without the flag a RuntimeError."""
    problems, where = [], f"{cls.__name__} {kwargs}"
    torch.manual_seed(0)
    plain, plain_info = cls.from_pretrained(directory, output_loading_info=True, ignore_mismatched_sizes=True,
                                            **kwargs)
    torch.manual_seed(0)
    with auto_patch(plan, artifact_dir=art):
        ours, ours_info = cls.from_pretrained(directory, output_loading_info=True, ignore_mismatched_sizes=True,
                                              **kwargs)
    if ours_info != plain_info or not plain_info["mismatched_keys"]:
        problems.append(f"{where}: {ours_info} vs {plain_info}")
    experts, theirs = expert_weights(ours), plain.state_dict()
    for name, t in ours.state_dict().items():
        want = local_rows(*experts[name], theirs[name]) if name in experts else theirs[name]
        if not torch.equal(t, want):
            problems.append(f"{where}: {name}")
    try:
        with auto_patch(plan, artifact_dir=art):
            cls.from_pretrained(directory, **kwargs)
        problems.append(f"{where}: loaded without ignore_mismatched_sizes")
    except RuntimeError as e:
        if "ignore_mismatched_sizes=True" not in str(e):
            problems.append(f"{where}: {e}")
    return problems


def count_routing(model) -> tuple[dict, list]:
    """Hooks on the experts (``layers.<i>.mlp.experts``) of an unmodified model counting, by hand, the
    experts its routers chose (the ``top_k_index`` the block hands them): ``{layer: [E] counts}``
    summed over its forwards, and the hooks' handles."""
    counts, handles = {}, []

    def hook_for(layer: int):
        def hook(module, args, kwargs):
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            chosen = torch.bincount(index.reshape(-1), minlength=module.num_experts)
            counts[layer] = counts[layer] + chosen if layer in counts else chosen
        return hook

    for name, m in model.named_modules():
        found = re.search(r"layers\.(\d+)\.mlp\.experts$", name)
        if found:
            handles.append(m.register_forward_pre_hook(hook_for(int(found.group(1))), with_kwargs=True))
    assert handles, "no experts found"
    return counts, handles


def z_loss_by_hand(model):
    """Hooks on the routers (``layers.<i>.mlp.gate``) of an unmodified model keeping, per call, the
    logsumexp of its logits (its input times its weight, in fp32); ``z(mask)`` is ST-MoE's router z-loss of
    the calls kept since the last ``z``: the mean over unpadded tokens of logsumexp squared, summed over
    the layers."""
    kept = []

    def hook(module, args, out):
        kept.append(torch.logsumexp(args[0].reshape(-1, args[0].shape[-1]).float() @ module.weight.float().T, -1))

    for name, m in model.named_modules():
        if re.search(r"layers\.\d+\.mlp\.gate$", name):
            m.register_forward_hook(hook)

    def z(mask=None):
        flat = None if mask is None else mask.reshape(-1).float()
        total = sum(lse.square().sum() if flat is None else (lse.square() * flat).sum() for lse in kept)
        tokens = kept[0].numel() if flat is None else flat.sum()
        kept.clear()
        return total / tokens

    return z


def assert_routing_logged(r: dict, steps: int, rank: int, ep: int = 2) -> None:
    """The ``moe/`` values a run logged after each of its ``steps`` optimizer steps equal what a hand
    count of the unmodified model's routers gives on the same global batches (``hand_routing``: per
    step, per layer, the experts chosen); rank 0's counts file holds those counts themselves. The rank
    imbalance is that of the ``ep`` ranks' consecutive blocks of experts, the same after balancing (off)."""
    logs, hand = r["routing"]["logs"], r["hand_routing"]
    assert len(logs) == len(hand) == steps, (logs, hand)
    for step, (logged, layers) in enumerate(zip(logs, hand, strict=True)):
        imbalance = [max(c) * len(c) / sum(c) for c in layers]
        ranks = [[sum(c[i * len(c) // ep : (i + 1) * len(c) // ep]) for i in range(ep)] for c in layers]
        by_rank = [max(x) * ep / sum(x) for x in ranks]
        assert logged["moe/imbalance"] == pytest.approx(max(imbalance), rel=1e-12), (step, logged, layers)
        assert logged["moe/rank_imbalance"] == pytest.approx(max(by_rank), rel=1e-12), (step, logged, ranks)
        assert logged["moe/rank_imbalance_balanced"] == logged["moe/rank_imbalance"], logged
        for i, value in enumerate(imbalance):
            assert logged[f"moe/layer_{i}/imbalance"] == pytest.approx(value, rel=1e-12), (step, i, logged, layers)
            assert logged[f"moe/layer_{i}/rank_imbalance"] == pytest.approx(by_rank[i], rel=1e-12), (step, i, logged)
        assert logged["moe/dead_experts"] == sum(c.count(0) for c in layers), (step, logged, layers)
        assert logged["moe/dropped_fraction"] == 0.0 and logged["moe/exchange_bytes_per_step"] > 0, logged
    if rank == 0:
        written = [[layer["tokens_per_expert"] for layer in line["layers"]] for line in r["routing"]["file"]]
        assert written == hand, (written, hand)
        assert [line["steps"] for line in r["routing"]["file"]] == [1] * steps
