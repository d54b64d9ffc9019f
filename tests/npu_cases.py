"""Whole-model parity with ``runtime.compute: npu`` through the torch_npu stand-in (tests/npu_standin).

The rank functions put the stand-in on ``sys.path`` themselves, inside the spawned ranks only, so the
pytest process never imports ``torch_npu``. Each case returns its worst relative error (logits and
every gradient against the unmodified model on the whole batch) and the stand-in's call counts after
the forward and after the backward.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

STANDIN = str(Path(__file__).resolve().parent / "npu_standin")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "bf16": 3e-2}


def use_standin():
    if STANDIN not in sys.path:
        sys.path.insert(0, STANDIN)
    import torch_npu

    assert torch_npu.STANDIN
    return torch_npu


def compare(case: dict, out_dir: str, rank: int, world: int) -> dict:
    from hp_rewrite.rewrite import generate, install
    from hp_rewrite.runtime import ExpertParallelGroup, build_expert_parallel_group, exchange_runtimes
    from hp_rewrite.tiny import build_tiny_model, tiny_config
    from hp_rewrite.verify import gradient_errors
    from tests.rewrite_cases import _rel, plan_for

    torch_npu = use_standin()
    dtype = DTYPES[case["dtype"]]
    ep_size = case.get("ep_size", world)  # ep_size 1 in a world of 2: EP=1 with two data-parallel replicas
    plan = plan_for(ep_size, compute="npu", **case.get("runtime", {}))
    ep = build_expert_parallel_group(ep_size) if world > 1 else ExpertParallelGroup.single()
    ref = build_tiny_model(tiny_config(case["model_type"]), seed=0).to(dtype)
    model = copy.deepcopy(ref)
    _, artifact = generate(model, plan, model.config, Path(out_dir) / case["name"])
    patched = install(model, artifact, plan, ep)
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2 * world, 8), generator=gen)
    mine = slice(rank * 2, (rank + 1) * 2)
    ref_out = ref(input_ids=ids).logits
    torch_npu.CALLS.clear()
    out = model(input_ids=ids[mine]).logits
    forward_calls = dict(torch_npu.CALLS)
    upstream = torch.randn(ref_out.shape, generator=gen).to(dtype)
    (ref_out * upstream).sum().backward()
    (out * upstream[mine]).sum().backward()
    errors = {"logits": _rel(out.detach().float(), ref_out.detach()[mine].float())}
    for name, (_, rel) in gradient_errors(model, ref, ep, world).items():
        errors[f"grad/{name}"] = rel
    worst = max(errors, key=errors.get)
    jobs = sum(r.weight_grads.jobs_run for r in exchange_runtimes(model)) if world > 1 else 0
    layers = sum(getattr(m, "hp_expert_parallel", None) is not None for m in model.modules())
    return {"layers": layers, "patched": patched, "worst": worst, "worst_err": errors[worst], "tol": TOL[case["dtype"]],
            "forward_calls": forward_calls, "calls": dict(torch_npu.CALLS), "deferred_jobs": jobs}


def run_cases(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    return {c["name"]: compare(c, payload["out_dir"], rank, world) for c in payload["cases"]}
