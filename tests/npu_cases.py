"""Whole-model parity with ``runtime.compute: npu`` through the torch_npu stand-in (tests/npu_standin).

The rank functions put the stand-in on ``sys.path`` themselves, inside the spawned ranks only, so the
pytest process never imports ``torch_npu``. Each case returns its worst relative error (logits and
every gradient against the unmodified model on the whole batch) and the stand-in's call counts after
the forward and after the backward.
"""

from __future__ import annotations

import copy
import importlib
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
    from hp_rewrite.runtime import installed
    from hp_rewrite.runtime.binding.install import exchange_runtimes
    from hp_rewrite.runtime.group.groups import ExpertParallelGroup, build_expert_parallel_group
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
    layers = sum(installed.binding(m) is not None for m in model.modules())
    return {"layers": layers, "patched": patched, "worst": worst, "worst_err": errors[worst], "tol": TOL[case["dtype"]],
            "forward_calls": forward_calls, "calls": dict(torch_npu.CALLS), "deferred_jobs": jobs}


def run_cases(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    return {c["name"]: compare(c, payload["out_dir"], rank, world) for c in payload["cases"]}


class _Experts(torch.nn.Module):
    """A plain fused SwiGLU experts holder ([E, 2I, H] / [E, H, I], like transformers' default layout)."""

    def __init__(self, n: int, h: int, i: int, gen: torch.Generator) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(n, 2 * i, h, generator=gen))
        self.down_proj = torch.nn.Parameter(torch.randn(n, h, i, generator=gen))
        self.act_fn = torch.nn.SiLU()


def permutations_bit_exact(rank: int, world: int, payload: dict) -> dict:
    """The same routed layer with the torch permutations and with the NPU permute ops (expert compute
    eager in both): outputs and every gradient must be bit for bit equal."""
    from hp_rewrite.runtime import dispatch, experts_and_combine
    from hp_rewrite.runtime.group.groups import build_expert_parallel_group
    from hp_rewrite.runtime.options import RuntimeOptions
    from hp_rewrite.runtime.pipeline.layer import ExpertParallelBinding
    dispatch_module = importlib.import_module("hp_rewrite.runtime.pipeline.dispatch")  # the module, not the function

    torch_npu = use_standin()
    torch.set_num_threads(1)
    ep = build_expert_parallel_group(world)
    experts, top_k, tokens, hidden_size = 8, 3, 24, 16
    gen = torch.Generator().manual_seed(10 + rank)
    holder = _Experts(experts // world, hidden_size, 8, gen)
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    indices = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=gen)
    upstream = torch.randn(tokens, hidden_size, generator=gen)
    results, calls = [], {}
    for npu_ops in (False, True):
        dispatch_module.npu_permute = _Wanted(npu_ops)  # the choice under test; the expert compute stays eager
        torch_npu.CALLS.clear()
        model = copy.deepcopy(holder)
        h, w = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        opts = RuntimeOptions(dedup=False, compute="eager", chunks=payload["chunks"])
        out = experts_and_combine(dispatch(h, indices, w, binding=ExpertParallelBinding.for_experts(experts, ep, opts)),
                                  model)
        (out * upstream).sum().backward()
        results.append([out.detach(), h.grad, w.grad, model.gate_up_proj.grad, model.down_proj.grad])
        calls = dict(torch_npu.CALLS)
    same = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    return {"bit_equal": same, "calls": calls}


class _Wanted:
    def __init__(self, value: bool) -> None:
        self.value = value

    def wanted(self, requested: str, device_type: str) -> bool:
        return self.value
