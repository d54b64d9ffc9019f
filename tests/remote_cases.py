"""Remote-code MoE models with module-list experts at EP=2 (each rank in a real gloo world)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hp_rewrite import auto_patch, sync_gradients
from hp_rewrite.plan import parse_plan


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)  # an expert no token chose: None upstream


def ep2_remote(rank: int, world: int, payload: dict) -> dict:
    """For each checkpoint: the local experts' modules, the bytes read, logits and every gradient
    against the unmodified remote model on the concatenated batch, and a save."""
    torch.set_num_threads(1)
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    results = {}
    for name, model_dir in payload["checkpoints"].items():
        ref = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).train()
        with auto_patch(plan, artifact_dir=Path(payload["gen_dir"])):
            ours = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).train()
        ids = torch.randint(0, 64, (2 * world, 7), generator=torch.Generator().manual_seed(3))
        mine = slice(2 * rank, 2 * rank + 2)
        theirs_out = ref(input_ids=ids, labels=ids)
        theirs_out.loss.backward()
        out = ours(input_ids=ids[mine], labels=ids[mine])
        out.loss.backward()
        sync_gradients(ours)
        ref_params = dict(ref.named_parameters())
        floor = 1e-3 * max(_grad(p).abs().max().item() for p in ref_params.values())
        grad_err = {n: ((_grad(p) - _grad(ref_params[n])).abs().max()
                        / max(_grad(ref_params[n]).abs().max().item(), floor)).item()
                    for n, p in ours.named_parameters()}
        held = sorted({n.split(".experts.")[1].split(".")[0] for n, _ in ours.named_parameters() if ".experts." in n})
        state = ours.state_dict()
        ours.save_pretrained(Path(payload["save_dir"]) / name)  # collective: rank 0 writes
        results[name] = {
            "logits_rel": ((out.logits - theirs_out.logits[mine]).abs().max()
                           / theirs_out.logits[mine].abs().max()).item(),
            "grad_worst": max(grad_err.values()), "grad_worst_name": max(grad_err, key=grad_err.get),
            "held": held, "experts_type": type(ours.model.layers[0].mlp.experts).__name__,
            "names_subset": set(state) <= set(ref.state_dict()),
            "bytes_read": ours.hp_rewrite.load_report["bytes_read"],
            "local_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        }
    results["fsdp"] = _fully_sharded_step(payload["checkpoints"]["softmax_gated_shared"], plan, rank, world,
                                          Path(payload["gen_dir"]))
    return results


def _fully_sharded_step(model_dir: str, plan, rank: int, world: int, gen_dir: Path) -> dict:
    """hp_rewrite.fully_shard on module-list experts: every gradient, gathered, against the reference."""
    import hp_rewrite

    ref = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).train()
    with auto_patch(plan, artifact_dir=gen_dir):
        ours = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).train()
    hp_rewrite.fully_shard(ours)
    ids = torch.randint(0, 64, (2 * world, 7), generator=torch.Generator().manual_seed(4))
    ref(input_ids=ids, labels=ids).loss.backward()
    ours(input_ids=ids[2 * rank:2 * rank + 2], labels=ids[2 * rank:2 * rank + 2]).loss.backward()
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for n, p in ours.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else _grad(p)
        want = _grad(ref_params[n])
        worst = max(worst, ((g - want).abs().max() / want.abs().max().clamp_min(1e-6)).item())
    experts = ours.model.layers[0].mlp.experts
    return {"grad_worst": worst, "sharded": type(experts).__name__.startswith("FSDP")}
