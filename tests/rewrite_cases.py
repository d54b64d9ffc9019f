"""Whole-model parity of the rewritten model against the unmodified transformers model.

Shared by the in-process EP=1 tests and the EP=2 gloo world: analyse + generate on the model,
install the generated forwards, then compare logits and every parameter gradient (fp32).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from hp_rewrite.plan import parse_plan
from hp_rewrite.rewrite import generate, install
from hp_rewrite.runtime import ExpertParallelGroup, build_expert_parallel_group
from hp_rewrite.tiny import build_tiny_model, tiny_config
from hp_rewrite.verify import gradient_errors

TOL = 1e-5
REQUIRED_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "deepseek_v2",
                     "gpt_oss", "dbrx"]  # dbrx: flat [E*I, H] expert weights in a child of the holder


def plan_for(ep_size: int, archetype: dict | None = None, **runtime) -> object:
    lines = [f"version: 1\nep_size: {ep_size}\n"]
    if archetype:
        lines.append("archetype:\n" + "".join(f"  {k}: {v}\n" for k, v in archetype.items()))
    if runtime:
        lines.append("runtime:\n" + "".join(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}\n"
                                            for k, v in runtime.items()))
    return parse_plan("".join(lines))


def _rel(a, b) -> float:
    if b is None:
        return 0.0 if a is None else a.abs().max().item()
    a = torch.zeros_like(b) if a is None else a
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if b.numel() else 0.0


def compare(model_type: str, out_dir: str, rank: int = 0, world: int = 1, ep_size: int = 1,
            router_logits: bool = False, archetype: dict | None = None, **runtime) -> dict:
    plan = plan_for(ep_size, archetype, **runtime)
    ep = build_expert_parallel_group(ep_size) if world > 1 else ExpertParallelGroup.single()
    ref = build_tiny_model(tiny_config(model_type), seed=0)
    model = copy.deepcopy(ref)
    analysis, artifact = generate(model, plan, model.config, Path(out_dir))
    patched = install(model, artifact, plan, ep)
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.get_text_config().vocab_size
    per_rank = 2
    ids = torch.randint(0, vocab, (per_rank * world, 8), generator=gen)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    kwargs = {"output_router_logits": True} if router_logits else {}
    ref_out = ref(input_ids=ids, **kwargs)
    out = model(input_ids=ids[mine], **kwargs)
    upstream = torch.randn(ref_out.logits.shape, generator=gen)
    ref_loss = (ref_out.logits * upstream).sum()
    loss = (out.logits * upstream[mine]).sum()
    errors = {"logits": _rel(out.logits.detach(), ref_out.logits.detach()[mine])}
    if router_logits:
        errors["aux_loss"] = _rel(out.aux_loss.detach(), ref_out.aux_loss.detach())
        ref_loss = ref_loss + ref_out.aux_loss
        loss = loss + out.aux_loss / world  # every rank adds the same aux loss of its own tokens
    ref_loss.backward()
    loss.backward()
    for name, (_, rel) in gradient_errors(model, ref, ep, world).items():
        errors[f"grad/{name}"] = rel
    worst = max(errors, key=errors.get)
    return {"patched": patched, "archetypes": [r.archetype.as_dict() for r in analysis.matched],
            "unmatched": [r.reason for r in analysis.unmatched], "worst": worst, "worst_err": errors[worst],
            "errors": {k: v for k, v in errors.items() if not k.startswith("grad/")}}


def run_world_cases(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    return {c["name"]: compare(c["model_type"], payload["out_dir"], rank, world, c.get("ep_size", world),
                               **c.get("runtime", {}))
            for c in payload["cases"]}
