"""Run a rewritten model on one rank of a local world and, optionally, check it.

Each rank loads the checkpoint as ``hp_rewrite.from_pretrained`` does (its own experts read; what the
checkpoint lacks drawn as plain transformers draws it, under the reference's seed), with the generated
forwards from the artifact and its EP group, runs forward and backward on its share of a random batch and, with ``verify``, compares the
logits and every parameter gradient with the unmodified model run on the whole batch in the same
process. The loss is a sum over the global batch, so replicated parameters' gradients are summed
over the world and expert gradients over the ranks holding the same experts before comparing. With
``tp_size > 1`` the ranks of a TP group share one batch and the dense parts are split over them, and
with ``cp_size > 1`` the ranks of a context group share one batch and split its sequence: the
gradients are those of :func:`~hp_rewrite.sync.gradients.reduce_gradients` (means over the batches)
times the number of batches, TP shards gathered.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .hf import pretrained_model
from .kernels import npu_permute
from .loading.patch import load_pretrained
from .loading.record import record_of
from .plan import Plan
from .runtime import installed
from .runtime.binding.install import expert_weights, local_rows
from .runtime.compute.experts import experts_implementation_of, kernel_choice
from .runtime.transport.exchange import permutations_used
from .sync.gradients import reduce_gradients

FP32_TOL = 1e-5


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               trust_remote_code: bool = False) -> nn.Module:
    """The checkpoint's model with an LM head when it has one (eager attention, eval mode)."""
    return pretrained_model(model_dir, dtype=dtype, trust_remote_code=trust_remote_code).eval()


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> tuple[float, float]:
    """(max abs error, max abs error / max(max |b|, floor))."""
    if not b.numel():
        return 0.0, 0.0
    err = (a.float() - b.float()).abs().max().item()
    return err, err / max(b.float().abs().max().item(), floor)


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def gradient_errors(model: nn.Module, ref: nn.Module, ep, world: int) -> dict[str, tuple[float, float]]:
    """(max abs, max rel) error of every parameter gradient of ``model`` against ``ref``'s.

    Expert weights are compared with the owning rank's slice of the reference, after summing over
    the ranks holding the same experts; replicated parameters after summing over the world. Relative
    errors are taken against max(|reference gradient|, 1e-3 x the model's largest gradient).
    """
    ref_params = dict(ref.named_parameters())
    shared_batch = ep.tp_size > 1 or ep.cp_size > 1
    if shared_batch:  # the contract's means over the batches, times their number: the global sums
        reduce_gradients(model, ep)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(world // (ep.tp_size * ep.cp_size))
    # A parameter whose gradient is tiny next to the model's largest (an unused router of a hash
    # layer, a gate that barely moves) holds only rounding noise: measure it against 1e-3 of the
    # largest gradient instead of against itself.
    scale = max((p.grad.abs().max().item() for p in ref_params.values() if p.grad is not None and p.grad.numel()),
                default=0.0)
    floor = max(1e-3 * scale, 1e-12)
    errors = {}
    weights = expert_weights(model)
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        ref_grad = ref_params[name].grad
        if name in weights:
            if ep.replica_group is not None and not shared_batch:
                dist.all_reduce(grad, group=ep.replica_group)
            ref_grad = None if ref_grad is None else local_rows(*weights[name], ref_grad)
        elif world > 1 and not shared_batch:
            dist.all_reduce(grad)
        errors[name] = _rel(grad, torch.zeros_like(grad) if ref_grad is None else ref_grad, floor)
    return errors


def kernel_choices(model: nn.Module, compute: str, device_type: str, dtype: torch.dtype) -> list[dict]:
    """The expert-compute backend of every installed holder and why, one row per distinct choice."""
    rows: dict[tuple, dict] = {}
    for name, m in model.named_modules():
        if installed.binding(m) is None:
            continue
        c = kernel_choice(compute, m, device_type, dtype, installed.layout(m))
        row = rows.setdefault((c.backend, c.reason), {**c.as_dict(), "experts_implementation":
                                                      experts_implementation_of(m), "holders": []})
        row["holders"].append(name)
    return list(rows.values())


def run_rank(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(max(1, payload.get("threads", 1)))
    plan = Plan.model_validate(payload["plan"])
    remote = payload.get("trust_remote_code", False)
    t0 = time.perf_counter()
    # hp_rewrite.from_pretrained's load: built on meta, only this rank's experts read from disk, what the
    # checkpoint lacks drawn as plain transformers draws it (the same seed as the reference's load); fp32
    # and eager attention, as the reference it is checked against; the dense parts split with tp_size > 1
    torch.manual_seed(payload.get("seed", 0))
    model = load_pretrained(lambda: pretrained_model(payload["model_dir"], dtype=torch.float32,
                                                     trust_remote_code=remote),
                            plan, Path(payload["artifact_root"]))
    info = record_of(model)
    report, patched, ep = info.load_report, info.patched, info.ep
    split = len(info.tensor.styles) if info.tensor is not None else None
    timings = {"load_s": time.perf_counter() - t0}
    torch.manual_seed(payload.get("seed", 0))
    ref = load_model(payload["model_dir"], trust_remote_code=remote) if payload["verify"] else None

    per_rank, seq = payload["batch_per_rank"], payload["seq_len"]
    gen = torch.Generator().manual_seed(payload.get("seed", 0))
    vocab = model.config.get_text_config().vocab_size
    sharing = plan.tp_size * plan.cp_size  # the ranks of a TP or context group share one batch
    batches = world // sharing
    ids = torch.randint(0, vocab, (per_rank * batches, seq), generator=gen)
    mine = slice(rank // sharing * per_rank, (rank // sharing + 1) * per_rank)

    t0 = time.perf_counter()
    out = _logits(model(input_ids=ids[mine]))
    # context.logits: local: this rank's positions of the logits (their backward carries the group's convention)
    positions = info.context.shares(seq).mine if out.shape[1] != seq else (0, seq)
    upstream = torch.randn((per_rank * batches, seq, *out.shape[2:]), generator=gen)
    (out * upstream[mine][:, positions[0]:positions[1]]).sum().backward()
    timings["ep_step_s"] = time.perf_counter() - t0
    result = {"patched": patched, "timings": timings,
              "kernels": kernel_choices(model, plan.runtime.compute, out.device.type, out.dtype),
              "permutations": permutations_used(plan.runtime.dedup, plan.ep_size,
                                                npu_permute.wanted(plan.runtime.compute, out.device.type)),
              # None where transformers read the whole checkpoint (not safetensors, ZeRO-3): sharded after
              "loaded_bytes": report and {"experts": report["expert_bytes"], "other": report["non_expert_bytes"]}}
    if split is not None:
        result["tensor_parallel"] = {"tp_size": plan.tp_size, "sequence_parallel": plan.sequence_parallel,
                                     "split_modules": split}
    if info.context is not None:
        result["context_parallel"] = {"cp_size": plan.cp_size, "scheme": plan.context.scheme,
                                      "attention_modules": len(info.context.attention)}
    if ref is None:
        return result

    t0 = time.perf_counter()
    ref_out = _logits(ref(input_ids=ids))
    (ref_out * upstream).sum().backward()
    timings["reference_step_s"] = time.perf_counter() - t0
    logits_abs, logits_rel = _rel(out.detach(), ref_out.detach()[mine][:, positions[0]:positions[1]])
    grads = gradient_errors(model, ref, ep, world)
    worst = max(grads, key=lambda n: grads[n][1]) if grads else ""
    result["verify"] = {
        "logits_max_abs": logits_abs,
        "logits_max_rel": logits_rel,
        "grad_max_abs": max((g[0] for g in grads.values()), default=0.0),
        "grad_max_rel": grads[worst][1] if worst else 0.0,
        "worst_grad": worst,
        "tolerance": FP32_TOL,
        "passed": logits_rel <= FP32_TOL and (not worst or grads[worst][1] <= FP32_TOL),
    }
    return result
