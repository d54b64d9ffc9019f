"""Tensor x sequence x expert parallelism against the unmodified model, on every rank of one gloo world.

The ranks of a TP group (consecutive ranks) share one batch, as in torchtitan; the TP groups hold
consecutive batches of the concatenated batch the unmodified model runs on.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from hp_rewrite import sync_gradients
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime.binding.install import expert_weights, local_rows
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests.engine_cases import lent_or_guests

TOL = 1e-5
PER_BATCH, SEQ = 2, 8


def reference(model_type: str, dtype: torch.dtype = torch.float32):
    config = tiny_config(model_type)
    config.num_key_value_heads = config.num_attention_heads  # tp 4 splits whole key/value heads too
    return build_tiny_model(config, seed=0).to(dtype).train()


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def worst_grad(model, ref) -> tuple[float, str]:
    """The largest gradient error of any parameter, relative to that parameter's largest gradient."""
    weights = expert_weights(model)
    ref_params = dict(ref.named_parameters())
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        target = ref_params[name].grad
        if name in weights:  # this rank's experts' rows of the reference
            target = local_rows(*weights[name], target)
        value = full(p.grad) if p.grad is not None else torch.zeros_like(target)
        err = ((value.float() - target.float()).abs().max() / max(target.abs().max().item(), 1e-12)).item()
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


def _case(rank: int, world: int, case: dict, out_dir: str) -> dict:
    model_type, ep_size, tp_size, sp = case["model_type"], case["ep"], case["tp"], case["sp"]
    dtype = torch.bfloat16 if case.get("bf16") else torch.float32
    ref = reference(model_type, dtype)
    balance = "runtime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1}\n" if case.get("balance") else ""
    plan = parse_plan(f"version: 1\nep_size: {ep_size}\ntp_size: {tp_size}\n"
                      f"sequence_parallel: {'true' if sp else 'false'}\n{balance}")
    mesh = None
    if case.get("user_mesh"):  # the user's ("dp", "tp") mesh, checked against the plan
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(out_dir), mesh=mesh)
    if mesh is not None and model.hp_rewrite.ep.tp_mesh is not mesh:
        raise AssertionError("the user's mesh was not used")
    if case.get("double_shared"):  # a caller reducing the shared expert's output again: must be caught
        for m in model.modules():
            if hasattr(m, "shared_experts"):
                m.shared_experts.register_forward_hook(lambda mod, a, out: _all_reduced(out, model))
    dp = world // tp_size
    vocab = ref.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (PER_BATCH * dp, SEQ), generator=torch.Generator().manual_seed(5))
    mine = slice(rank // tp_size * PER_BATCH, (rank // tp_size + 1) * PER_BATCH)
    ref_out = ref(input_ids=ids)
    lm_loss(ref_out.logits, ids).backward()
    out = model(input_ids=ids[mine])
    lm_loss(out.logits, ids[mine]).backward()
    sync_gradients(model)
    target = ref_out.logits[mine].float()
    logits = ((out.logits.float() - target).abs().max() / target.abs().max()).item()
    grad, grad_name = worst_grad(model, ref)
    split = sum(isinstance(p, DTensor) for p in model.parameters())
    return {"logits": logits, "grad": grad, "grad_name": grad_name, "dtensors": split,
            "moved": lent_or_guests(model)}


def _all_reduced(out: torch.Tensor, model) -> torch.Tensor:
    import torch.distributed as dist

    out = out.clone()
    dist.all_reduce(out, group=model.hp_rewrite.ep.tp_group)
    return out


def _refusal(case: dict, out_dir: str) -> str:
    """The message a case that cannot work raises (empty: it did not raise)."""
    from hp_rewrite.errors import UserError

    try:
        ref = reference(case["model_type"])
        if case.get("kv_heads"):
            ref.config.num_key_value_heads = case["kv_heads"]
        plan = parse_plan(f"version: 1\nep_size: {case['ep']}\ntp_size: {case['tp']}\n"
                          f"sequence_parallel: {'true' if case['sp'] else 'false'}\n")
        mesh = None
        if case.get("mesh"):  # a user's mesh that does not fit the plan
            from torch.distributed.device_mesh import init_device_mesh

            shape, names = case["mesh"]
            mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
        model = rewrite_model(ref, plan, artifact_dir=Path(out_dir), mesh=mesh)
        if case.get("engine") == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif case.get("engine") == "trainer":
            from transformers import Trainer, TrainingArguments

            import hp_rewrite

            args = TrainingArguments(output_dir=str(Path(out_dir) / "trainer"), report_to=[], use_cpu=True)
            hp_rewrite.prepare_trainer(Trainer(model=model, args=args))
        rank = torch.distributed.get_rank()
        ids = torch.full((1, case.get("seq", SEQ)), rank if case.get("engine") == "batch_per_rank" else 0)
        if case.get("engine") == "rows_swapped":  # one batch, its rows in another order on odd ranks
            ids = torch.arange(2 * case.get("seq", SEQ)).reshape(2, -1)
            ids = ids.flip(0) if rank % 2 else ids
        extra = {"output_attentions": True} if case.get("engine") == "attentions" else {}
        extra.update({"output_hidden_states": True} if case.get("engine") == "hidden_states" else {})
        model(input_ids=ids, **extra)
    except UserError as e:
        return str(e)
    return ""


def tp_world(rank: int, world: int, payload: dict) -> dict:
    """Every case of ``payload``: logits and every gradient (after ``sync_gradients``) of the rewritten
    model against the unmodified model on the concatenated batch; the refusals' messages."""
    torch.set_num_threads(1)
    results = {c["id"]: _case(rank, world, c, payload["out_dir"]) for c in payload["cases"]}
    results.update({c["id"]: _refusal(c, payload["out_dir"]) for c in payload.get("refusals", [])})
    if payload.get("memory"):  # the saved activations per decoder part at tp 1, tp 2, tp 2 with SP
        from tools.measure_train_memory import activation_worker

        results["memory"] = activation_worker(rank, world, payload["memory"])
    if payload.get("missing"):  # experts the checkpoint lacks, at EP 4 and TP-extended EP (#44)
        from tests.missing_experts_cases import missing_experts_world

        results["missing"] = missing_experts_world(rank, world, payload["missing"])
    if payload.get("weights"):  # checkpoint_weights at EP 4 and TP-extended EP (#46)
        from tests.weights_cases import checkpoint_weights_world

        results["weights"] = checkpoint_weights_world(rank, world, payload["weights"])
    return results
