"""Context x expert (x data) parallelism against the unmodified model, on every rank of one gloo world.

The ranks of a context group (consecutive ranks) share one batch and each holds its share of every
sequence; the context groups hold consecutive batches of the concatenated batch the unmodified model runs
on. Every case compares the logits (whole sequence, every rank), the loss with transformers' own loss and
load-balancing loss, and every gradient after the gradient sync the case names.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from hp_rewrite import sync_gradients
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime.binding.install import expert_weights, local_rows
from hp_rewrite.tiny import build_tiny_model, tiny_config

TOL = 1e-5
BF16_TOL = 3e-2
PER_BATCH = 2


def reference(case: dict, dtype: torch.dtype):
    config = tiny_config(case["model_type"])
    if case.get("kv_heads"):
        config.num_key_value_heads = case["kv_heads"]
    if hasattr(config, "router_jitter_noise"):  # PhiMoE's training-mode noise: not comparable between two models
        config.router_jitter_noise = 0.0
    if case.get("sliding") and getattr(config, "sliding_window", None):
        config.sliding_window = case["sliding"]
    if case.get("heads"):
        config.num_attention_heads = case["heads"]
    config.output_router_logits = bool(case.get("aux", True)) and hasattr(config, "router_aux_loss_coef")
    model = build_tiny_model(config, seed=0)
    if case.get("attn", "sdpa") != "eager":
        model.set_attn_implementation(case.get("attn", "sdpa"))
    return model.to(dtype).train()


def _plan(case: dict) -> str:
    text = f"version: 1\nep_size: {case['ep']}\ncp_size: {case['cp']}\ntp_size: {case.get('tp', 1)}\n"
    if case.get("local"):  # the head on this rank's positions
        text += "context:\n  logits: local\n"
    if case.get("balance"):  # every layer lends rows (threshold 1, any piece)
        text += "runtime:\n  balance: auto\n  balance_threshold: 1.0\n  balance_min_rows: 1\n"
    return text


def _batch(case: dict, vocab: int, dp: int):
    seq = case.get("seq", 12)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (PER_BATCH * dp, seq), generator=gen)
    mask = torch.ones_like(ids)
    if case.get("padding"):  # left padding on the first row of every batch
        mask[::PER_BATCH, :3] = 0
    return ids, mask


def run_case(rank: int, world: int, case: dict, out_dir: str) -> dict:
    dtype = torch.bfloat16 if case.get("bf16") else torch.float32
    ref = reference(case, dtype)
    if case.get("checkpointing"):  # as TRL's SFTConfig: recomputation in the backward, non-reentrant
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = rewrite_model(copy.deepcopy(ref), parse_plan(_plan(case)), artifact_dir=Path(out_dir))
    if case.get("generate"):
        return _generate(rank, case, ref, model)
    slicers = {}
    if case.get("lora"):  # LoRA (drawn non-zero, so every factor gets a gradient), the base frozen
        ref, model = _with_lora(ref, case["lora"]), _with_lora(model, case["lora"])
        if case["lora"] == "experts":  # each rank's experts' adapters: its rows of the reference's
            from tests.peft_cases import copy_local_adapters, expert_slicers

            slicers = expert_slicers(model, ref)
            with torch.no_grad():
                copy_local_adapters(model, ref, slicers)
    cp = case["cp"] * case.get("tp", 1)  # the ranks holding one batch: a block of tp x cp with TP
    dp = world // cp
    ids, mask = _batch(case, ref.config.get_text_config().vocab_size, dp)
    mine = slice(rank // cp * PER_BATCH, (rank // cp + 1) * PER_BATCH)
    labels = ids.masked_fill(mask == 0, -100)
    positions = None
    if case.get("packed"):  # padding-free: two sequences a row (5 + 7 positions), as DataCollatorWithFlattening
        positions = torch.cat([torch.arange(5), torch.arange(ids.shape[1] - 5)]).expand_as(ids)
        labels[:, 5] = -100  # its collator's boundary: no label across two sequences

    def inputs(rows: slice) -> dict:
        if positions is not None:  # no attention mask: the packed mask from position_ids, where transformers
            # builds one (with use_cache off, as Trainer's checkpointing turns it; with its own cache it does not)
            return {"input_ids": ids[rows], "position_ids": positions[rows], "labels": labels[rows],
                    **({"use_cache": False} if case["packed"] == "no_cache" else {})}
        if case.get("items"):  # a caller's count of the labelled tokens (Trainer's num_items_in_batch)
            count = (labels[rows][:, 1:] != -100).sum()
            return {"input_ids": ids[rows], "attention_mask": mask[rows], "labels": labels[rows],
                    "num_items_in_batch": count}
        return {"input_ids": ids[rows], "attention_mask": mask[rows], "labels": labels[rows]}

    # the unmodified model on each data-parallel batch (the load-balancing loss is per micro-batch, as
    # transformers'), gradients averaged over the batches: what DDP makes of data parallelism alone
    ref_outs = [ref(**inputs(slice(b * PER_BATCH, (b + 1) * PER_BATCH))) for b in range(dp)]
    (sum(o.loss for o in ref_outs) / dp).backward()
    ref_out = ref_outs[rank // cp]
    seen = []  # the sequence length the decoder layers and the experts run on: this rank's share
    decoder = model.hp_rewrite.context.decoder
    decoder.layers[-1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    if case.get("engine") == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif case.get("engine") == "fsdp":  # FSDP2 over the data x context ranks: a mean over them, as DDP's
        import hp_rewrite

        hp_rewrite.fully_shard(model)
    forward = torch.compile(model, backend=case["compile"]) if case.get("compile") else model
    inner = model.module if case.get("engine") == "ddp" else model
    if case.get("custom"):  # the caller's own loss from the local logits: this rank's part, not summed
        out = forward(**{k: v for k, v in inputs(mine).items() if k != "labels"})
        out.loss = _own_loss(out.logits, labels[mine], inner.hp_rewrite.context)
    else:
        out = forward(**inputs(mine))
    out.loss.backward()
    if case.get("custom"):  # its value summed over the group, for the comparison
        out.loss = out.loss.detach().clone()
        dist.all_reduce(out.loss, group=inner.hp_rewrite.context.group)
    if case.get("engine") not in ("ddp", "fsdp"):
        sync_gradients(inner)
    target = ref_out.logits.float()
    if case.get("local"):  # this rank's positions of the reference's
        target = target[:, inner.hp_rewrite.context.shares(target.shape[1]).mine[0]:][:, :out.logits.shape[1]]
    logits = ((out.logits.float() - target).abs().max() / target.abs().max()).item()
    loss = abs(out.loss.item() - ref_out.loss.item()) / abs(ref_out.loss.item())
    grad, grad_name = worst_grad(inner, ref, slicers)
    moved = sum(getattr(s, "lent", 0) for s in _dispatch_stats(inner))
    twin = None
    if case.get("deepcopy"):  # a deep copy (a reference or EMA model) splits and scores with its own state
        copied = copy.deepcopy(inner)
        with torch.no_grad():
            got = copied(**inputs(mine))
        twin = [list(got.logits.shape), abs(got.loss.item() - ref_out.loss.item()) / abs(ref_out.loss.item()),
                copied.hp_rewrite.context is not inner.hp_rewrite.context]
    kept = None
    if case.get("local") and not case.get("compile"):  # logits_to_keep: the last position, which one rank holds:
        # this forward runs whole (not compiled again: the eager cases check it)
        unlabelled = {k: v for k, v in inputs(mine).items() if k not in ("labels", "num_items_in_batch")}
        with torch.no_grad():
            last, want = forward(**unlabelled, logits_to_keep=1).logits, ref(**unlabelled, logits_to_keep=1).logits
        kept = [list(last.shape), ((last - want).abs().max() / want.abs().max()).item()]
    dense_split = any("tp" in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())
                      for p in inner.parameters())  # tp_size: slices over a TP mesh
    return {"logits": logits, "loss": loss, "grad": grad, "grad_name": grad_name, "dense_split": dense_split,
            "shape": list(out.logits.shape), "moved": moved, "layer_seq": seen[0] if seen else None, "kept": kept,
            "twin": twin}


def _own_loss(logits, labels, context) -> torch.Tensor:
    """Cross-entropy of this rank's positions, labels shifted over the whole sequence, divided by the whole
    sequence's count of labelled tokens (what a caller of ``context.logits: local`` writes)."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    start, end = context.shares(labels.shape[1]).mine
    mine = shifted[:, start:end].reshape(-1)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), mine, ignore_index=-100,
                                             reduction="sum") / (shifted != -100).sum()


def _with_lora(model, where):
    """LoRA on attention (``True``) or on attention and the fused experts (``"experts"``)."""
    from peft import LoraConfig, get_peft_model

    targets = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]} if where == "experts" else {}
    torch.manual_seed(11)  # the same factors for the reference and the context-parallel model
    return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj", "o_proj"],
                                            init_lora_weights=False, **targets))


def _generate(rank: int, case: dict, ref, model) -> dict:
    """Greedy generation from each context group's prompt (lockstep with the expert exchange)."""
    prompt = torch.randint(0, ref.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(rank // case["cp"]))
    seen = []
    model.hp_rewrite.context.decoder.layers[-1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    ref.eval(), model.eval()
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        got = model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        torch.manual_seed(rank)  # each rank its own random stream: the group still returns one sample
        sampled = model.generate(prompt, max_new_tokens=4, do_sample=True, pad_token_id=0)
    return {"tokens": got.tolist(), "reference": want.tolist(), "layer_seq_generate": seen[0], "prompt": 6,
            "sampled": sampled.tolist()}


def worst_grad(model, ref, slicers: dict | None = None) -> tuple[float, str]:
    """The largest gradient error of any parameter, relative to that parameter's largest gradient (a parameter
    the unmodified model gives no gradient must get none, or zeros)."""
    weights = expert_weights(model)
    ref_params = dict(ref.named_parameters())
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        target = ref_params[name].grad
        if target is None:
            target = torch.zeros_like(ref_params[name])
        if name in weights:  # this rank's experts' rows of the reference
            target = local_rows(*weights[name], target)
        elif slicers and name in slicers:  # this rank's experts' adapters
            target = slicers[name](target)
        value = p.grad if p.grad is not None else torch.zeros_like(target)
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        err = ((value.float() - target.float()).abs().max() / max(target.abs().max().item(), 1e-12)).item()
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


def _dispatch_stats(model) -> list:
    from hp_rewrite.runtime import installed

    return [s for m in model.modules() if installed.binding(m) is not None
            and (s := installed.last_stats(m)) is not None]


def refusal(case: dict, out_dir: str) -> str:
    """The message a case that cannot work raises (empty: it did not raise)."""
    from hp_rewrite.errors import UserError

    try:
        ref = reference(case, torch.float32)
        model = rewrite_model(ref, parse_plan(_plan(case)), artifact_dir=Path(out_dir))
        rank = dist.get_rank()
        ids = torch.full((1, case.get("seq", 12)), rank if case.get("engine") == "batch_per_rank" else 0)
        if case.get("engine") == "rows_swapped":  # one batch, its rows in another order on odd ranks
            ids = torch.arange(2 * case.get("seq", 12)).reshape(2, -1).flip(0) if rank % 2 else \
                torch.arange(2 * case.get("seq", 12)).reshape(2, -1)
        model(input_ids=ids)
    except UserError as e:
        return str(e)
    return ""


def context_world(rank: int, world: int, payload: dict) -> dict:
    """Every case of ``payload`` (:func:`run_case`) and the refusals' messages."""
    torch.set_num_threads(1)
    results = {c["id"]: run_case(rank, world, c, payload["out_dir"]) for c in payload["cases"]}
    results.update({c["id"]: refusal(c, payload["out_dir"]) for c in payload.get("refusals", [])})
    return results
