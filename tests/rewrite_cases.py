"""Whole-model parity of the rewritten model against the unmodified transformers model.

Shared by the in-process EP=1 tests and the EP=2 gloo world: analyse + generate on the model,
install the generated forwards, then compare logits and every parameter gradient (fp32).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from hp_rewrite.plan import parse_plan
from hp_rewrite.rewrite import generate, install
from hp_rewrite.runtime import installed
from hp_rewrite.runtime.group.groups import ExpertParallelGroup, build_expert_parallel_group
from hp_rewrite.tiny import build_tiny_model, tiny_config
from hp_rewrite.verify import gradient_errors
from tests.host_traffic import HostTraffic

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
    stats = [installed.last_stats(h) for _, h in installed.holders(model)]
    return {"patched": patched, "archetypes": [r.archetype.as_dict() for r in analysis.matched],
            "unmatched": [r.reason for r in analysis.unmatched], "worst": worst, "worst_err": errors[worst],
            "errors": {k: v for k, v in errors.items() if not k.startswith("grad/")},
            "guests": sum(st.guests for st in stats if st is not None)}  # runtime.balance: experts computed for others


def host_traffic(model_type: str, out_dir: str, ep_size: int, **runtime) -> dict:
    """Host reads and host->device uploads per MoE layer in one training step of the rewritten model
    (:mod:`tests.host_traffic`): in each layer's forward (and whether its shared expert was queued
    before the first read), and in the whole backward."""
    plan = plan_for(ep_size, **runtime)
    ep = build_expert_parallel_group(ep_size)
    model = build_tiny_model(tiny_config(model_type), seed=0)
    _, artifact = generate(model, plan, model.config, Path(out_dir))
    blocks = [model.get_submodule(p) for p in install(model, artifact, plan, ep)]
    probe = HostTraffic()
    layers = []

    def enter(block, _args):
        layers.append({"reads": len(probe.reads), "uploads": len(probe.uploads), "events": len(probe.events)})

    def leave(block, _args, _out):
        start = layers[-1]
        events = probe.events[start["events"]:]
        first_read = events.index("read") if "read" in events else len(events)
        start.update(reads=probe.reads[start["reads"]:], uploads=probe.uploads[start["uploads"]:],
                     shared_first="shared" not in events or events.index("shared") < first_read,
                     has_shared="shared" in events)

    for block in blocks:
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
        for name in ("shared_experts", "shared_expert"):
            if isinstance(getattr(block, name, None), torch.nn.Module):
                getattr(block, name).register_forward_pre_hook(lambda *_: probe.mark("shared"))
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=ids)  # a first forward fills what is built once per model (the placement's slot table)
    with probe:
        loss = model(input_ids=ids).logits.float().pow(2).mean()
        backward_start = (len(probe.reads), len(probe.uploads))
        loss.backward()
    layers = layers[len(blocks):]  # the measured step's forward
    return {"layers": len(blocks), "forward": [{"reads": lay["reads"], "uploads": lay["uploads"],
                                                "shared_first": lay["shared_first"], "has_shared": lay["has_shared"]}
                                               for lay in layers],
            "backward_reads": probe.reads[backward_start[0]:], "backward_uploads": probe.uploads[backward_start[1]:]}


def run_world_cases(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    results = {c["name"]: compare(c["model_type"], payload["out_dir"], rank, world, c.get("ep_size", world),
                                  **c.get("runtime", {}))
               for c in payload["cases"]}
    for c in payload.get("host_traffic", []):
        results[f"host-{c['name']}"] = host_traffic(c["model_type"], payload["out_dir"], world, **c.get("runtime", {}))
    return results


def load_beside_another_world(rank: int, world: int, payload: dict) -> dict:
    """One of two worlds started at once that load one checkpoint into one artifact directory (two
    torchrun jobs, or every node's rank 0 on a shared home directory): all ranks of both worlds meet at
    a file gate first, so both rank 0s find, write or replace the artifact at the same moment."""
    import time

    import hp_rewrite

    torch.set_num_threads(1)
    gate = Path(payload["gate"])
    (gate / f"{payload['world_id']}-{rank}").touch()
    deadline = time.monotonic() + 120
    while len(list(gate.iterdir())) < payload["ranks"]:  # every rank of both worlds is here
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other world never reached the gate {gate}")
        time.sleep(0.01)
    model = hp_rewrite.from_pretrained(payload["model_dir"], plan=parse_plan("version: 1\nep_size: 2\n"),
                                       artifact_dir=Path(payload["artifact_dir"]))
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {"logits": logits.flatten()[:64].tolist()}
