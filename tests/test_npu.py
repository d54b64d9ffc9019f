"""The Ascend path (``runtime.compute: npu``) end to end through a torch_npu stand-in.

In this process only the kernel functions run, over :func:`reference_grouped_matmul` (the documented
semantics) with an injected kernel; ``torch_npu`` itself never imports here. The whole-model cases
and ``hp-rewrite apply`` run in spawned ranks with ``tests/npu_standin`` on their path, and check the
logits and every gradient against the unmodified model (fp32 1e-5, bf16 3e-2 relative to the largest
reference value) and that the forward, input-gradient, weight-gradient and activation calls reached
the stand-in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hp_rewrite import kernels
from hp_rewrite.kernels import KernelProblem, choose, npu
from hp_rewrite.launch import run_world
from hp_rewrite.runtime.compute.experts import resolve_compute
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.overlap.deferred import WeightGradQueue, grouped_grad_sink
from hp_rewrite.tiny import make_tiny
from tests.npu_cases import STANDIN

ROOT = Path(__file__).resolve().parents[1]
COUNTS = [[3, 0, 4, 1], [0, 0, 5, 0], [7], [0, 0, 0]]
H, I = 6, 4  # noqa: E741 - hidden, intermediate


def _counting(calls: list):
    def kernel(**kw):
        calls.append(kw["group_type"])
        return npu.reference_grouped_matmul(**kw)

    return kernel


def _silu_gate(h: torch.Tensor) -> torch.Tensor:
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def _clamped_interleaved(h: torch.Tensor) -> torch.Tensor:  # gpt-oss's gate
    g, u = h[..., ::2].clamp(max=0.5), h[..., 1::2].clamp(-0.5, 0.5)
    return (u + 1) * g * torch.sigmoid(1.702 * g)


def _loop_mlp(x, w_up, w_down, counts, act):
    outs = [act(xe @ wu) @ wd for xe, wu, wd in zip(x.split(counts), w_up, w_down, strict=True)]
    return torch.cat(outs) if outs else x.new_empty((0, w_down.shape[-1]))


def test_standin_is_not_importable_here() -> None:
    assert importlib.util.find_spec("torch_npu") is None and npu.available() is False
    assert (Path(STANDIN) / "torch_npu" / "__init__.py").exists()


@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_reference_k_grouped_is_every_experts_weight_gradient(counts) -> None:
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(sum(counts), H, generator=gen), torch.randn(sum(counts), I, generator=gen)
    (dw,) = npu.reference_grouped_matmul(**npu.weight_grad_args(x, dy, counts))
    loop = torch.stack([xe.t() @ de for xe, de in zip(x.split(counts), dy.split(counts), strict=True)])
    assert dw.shape == (len(counts), H, I) and torch.allclose(dw, loop, atol=1e-6)
    args = {**npu.weight_grad_args(x, dy, counts), "group_list": torch.tensor(counts), "group_list_type": 1}
    assert torch.equal(npu.reference_grouped_matmul(**args)[0], dw)


@pytest.mark.parametrize("act", [_silu_gate, _clamped_interleaved], ids=["swiglu", "gpt_oss_gate"])
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_grouped_swiglu_matches_autograd_with_one_call_per_gemm(counts, act) -> None:
    gen = torch.Generator().manual_seed(1)
    e = len(counts)
    x = torch.randn(sum(counts), H, generator=gen)
    w_up, w_down = torch.randn(e, H, 2 * I, generator=gen), torch.randn(e, I, H, generator=gen)
    dy = torch.randn(sum(counts), H, generator=gen)
    a = [t.clone().requires_grad_(True) for t in (x, w_up, w_down)]
    calls: list[int] = []
    out = npu.grouped_swiglu(*a, counts, activation=act, kernel=_counting(calls))
    assert calls == [0, 0]  # gate_up, down: one m-grouped call each
    (out * dy).sum().backward()
    assert sorted(calls[2:]) == [0, 0, 2, 2]  # dX twice (m-grouped), dW twice (k-grouped): no per-expert loop
    b = [t.clone().requires_grad_(True) for t in (x, w_up, w_down)]
    ref = _loop_mlp(*b, counts, act)
    (ref * dy).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(a, b, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_deferred_weight_gradients_are_one_k_grouped_job_per_projection(transposed) -> None:
    counts = [3, 0, 4, 1]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), H, generator=gen, requires_grad=True)
    up = torch.nn.Parameter(torch.randn(4, H, 2 * I, generator=gen))  # stored [E, in, out] when transposed
    down = torch.nn.Parameter(torch.randn(4, I, H, generator=gen))
    if not transposed:
        up, down = (torch.nn.Parameter(p.detach().transpose(1, 2).contiguous()) for p in (up, down))

    def in_out(p):
        return p if transposed else p.transpose(1, 2)

    queue, calls = WeightGradQueue(), []
    sinks = (grouped_grad_sink(queue, up, transposed), grouped_grad_sink(queue, down, transposed))
    out = npu.grouped_swiglu(x, in_out(up).detach(), in_out(down).detach(), counts, activation=_silu_gate,
                             kernel=_counting(calls), defer=sinks)
    out.sum().backward()
    assert queue.jobs_run == 2 and len(queue) == 0 and calls.count(2) == 2
    got = (up.grad.clone(), down.grad.clone(), x.grad.clone())
    for p in (up, down, x):
        p.grad = None
    _loop_mlp(x, in_out(up), in_out(down), counts, _silu_gate).sum().backward()
    for g, p in zip(got, (up, down, x), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5)


def test_double_backward_is_refused() -> None:
    from hp_rewrite.errors import UserError

    x, w_up, w_down = torch.randn(3, H, requires_grad=True), torch.randn(1, H, 2 * I), torch.randn(1, I, H)
    out = npu.grouped_swiglu(x, w_up, w_down, [3], activation=_silu_gate, kernel=npu.reference_grouped_matmul)
    with pytest.raises(UserError, match="first order only"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_choice_and_its_reason(monkeypatch) -> None:
    cpu = KernelProblem("cpu", torch.float32, 8, (16, 32), torch.float32)
    assert choose("auto", cpu).backend == "grouped" and choose("eager", cpu).backend == "eager"
    no_npu = choose("npu", cpu)
    assert no_npu.backend is None and "torch_npu does not import" in no_npu.reason
    with pytest.raises(ExpertParallelError, match="compute=npu"):
        resolve_compute("npu", torch.zeros(2, 16), torch.zeros(8, 16, 32))
    monkeypatch.setattr(kernels.registry.npu, "available", lambda: True)
    assert choose("npu", cpu).backend == "npu" and choose("auto", cpu).backend == "grouped"
    on_npu = KernelProblem("npu", torch.bfloat16, 8, (16, 32), torch.bfloat16)
    assert choose("auto", on_npu).backend == "npu" and choose("grouped", on_npu).backend == "npu"
    many = choose("npu", KernelProblem("cpu", torch.float32, 2048, (16, 32), torch.float32))
    assert many.backend == "grouped" and "2048 local experts > 1024" in many.reason
    wide = choose("npu", KernelProblem("cpu", torch.float32, 8, (16, 70000), torch.float32))
    assert wide.backend == "grouped" and "inner dimension 70000" in wide.reason
    assert choose("auto", KernelProblem("npu", torch.float32, 2048, (16,), torch.float32)).backend == "eager"
    assert choose("npu", KernelProblem("cpu", torch.int8, 8, (16,), torch.int8)).backend is None


def _check(results: list[dict]) -> None:
    for rank in results:
        for name, r in rank.items():
            assert r["worst_err"] <= r["tol"], (name, r["worst"], r["worst_err"])
            layers, calls, fwd = r["layers"], r["calls"], r["forward_calls"]
            # per layer: the dropless un-sort before the combine is npu_moe_token_unpermute; per slot at EP=2
            # the received rows are sorted expert-major by npu_moe_token_permute and put back by unpermute
            # (the deduplicated exchange, the default at EP=2, has no permutation to give the NPU ops)
            per_slot_ep2 = "ep2" in name and "per-slot" in name
            permute = {"token_permute": layers} if per_slot_ep2 else {}
            unpermute = {"token_unpermute": (2 if per_slot_ep2 else 1) * layers} if "ep2" not in name or per_slot_ep2 \
                else {}
            swiglu = {"swiglu": layers} if "gpt_oss" not in name else {}
            assert fwd == {"grouped_matmul_m": 2 * layers, **swiglu, **permute, **unpermute}, (name, fwd)
            assert calls["grouped_matmul_m"] == 4 * layers and calls["grouped_matmul_k"] == 2 * layers, name
            if "gpt_oss" not in name:  # npu_swiglu's own backward; gpt-oss keeps its clamped gate
                assert calls["swiglu_backward"] == layers
            # every permutation's gradient goes through the op's own backward
            assert calls.get("token_permute_backward", 0) == permute.get("token_permute", 0), (name, calls)
            assert calls.get("token_unpermute_backward", 0) == unpermute.get("token_unpermute", 0), (name, calls)
            assert r["deferred_jobs"] == (2 * layers if "defer" in name else 0)


def _cases(ep_size: int, *specs) -> list[dict]:
    suffix = {"defer": {"defer_expert_grads": True}, "per-slot": {"dedup": False}}
    return [{"name": f"ep{ep_size}-{m}-{d}" + (f"-{rt}" if rt else ""), "model_type": m, "dtype": d,
             "ep_size": ep_size, "runtime": suffix.get(rt, {})} for m, d, rt in specs]


def test_whole_model_with_the_standin_ep1_and_ep2(tmp_path: Path) -> None:
    """One gloo world of 2 ranks: EP=1 cases (each rank holds every expert, two data-parallel replicas)
    and EP=2 cases; qwen3_moe fp32 at EP=2 without deferral is test_apply_verify_with_compute_npu."""
    cases = _cases(1, ("qwen3_moe", "fp32", ""), ("qwen3_moe", "bf16", ""), ("qwen2_moe", "fp32", ""),
                   ("gpt_oss", "fp32", ""), ("gpt_oss", "bf16", ""))
    cases += _cases(2, ("qwen3_moe", "fp32", "defer"), ("qwen2_moe", "bf16", ""), ("gpt_oss", "bf16", ""),
                    ("qwen2_moe", "fp32", "per-slot"))
    _check(run_world(2, "tests.npu_cases:run_cases", {"out_dir": str(tmp_path), "cases": cases}))


@pytest.mark.parametrize("chunks", [1, 2])
def test_npu_permutations_are_bit_for_bit_the_torch_ones(chunks: int) -> None:
    """At EP=2 per slot: the received rows sorted expert-major, returned, and un-sorted before the combine
    by the NPU ops give exactly the torch path's outputs and gradients (hidden, router weights, experts)."""
    for r in run_world(2, "tests.npu_cases:permutations_bit_exact", {"chunks": chunks}):
        assert r["bit_equal"], r
        assert r["calls"] == {"token_permute": chunks, "token_unpermute": 2 * chunks,
                              "token_permute_backward": chunks, "token_unpermute_backward": 2 * chunks}, r


def test_apply_verify_with_compute_npu(tmp_path: Path) -> None:
    """``hp-rewrite apply`` in a process with the stand-in on PYTHONPATH (spawned ranks inherit sys.path)."""
    model = make_tiny("qwen3_moe", tmp_path / "ckpt")
    plan = tmp_path / "npu.yaml"
    plan.write_text("version: 1\nep_size: 2\nruntime:\n  compute: npu\n")
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([STANDIN, str(ROOT)])}
    cmd = [sys.executable, "-m", "hp_rewrite.cli", "apply", str(plan), str(model), "--out", str(tmp_path / "gen"),
           "--nproc", "2", "--verify", "--report", str(report)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "expert compute (rank 0, 2 block(s), experts_implementation grouped_mm): npu" in done.stdout
    assert "row permutations (rank 0): torch - the deduplicated exchange" in done.stdout  # dedup: the default
    data = json.loads(report.read_text())
    assert data["verify"]["passed"] and data["verify"]["grad_max_rel"] <= 1e-5
    for rank in data["ranks"]:
        (k,) = rank["kernels"]
        assert k["backend"] == "npu" and "torch_npu imports" in k["reason"] and len(k["holders"]) >= 1


@pytest.mark.parametrize("column_major", [False, True])
def test_grouped_mm_alignment_padding_keeps_results_and_gradients(column_major) -> None:
    from hp_rewrite.kernels import torch_grouped

    gen = torch.Generator().manual_seed(4)
    counts, k, n = [3, 0, 5], 13, 7  # neither a multiple of 8 bf16 elements
    x = torch.randn(sum(counts), k, generator=gen, dtype=torch.float64).to(torch.bfloat16).requires_grad_(True)
    stored = torch.randn(3, n, k, generator=gen).to(torch.bfloat16) if column_major else \
        torch.randn(3, k, n, generator=gen).to(torch.bfloat16)
    stored.requires_grad_(True)
    w = stored.transpose(1, 2) if column_major else stored
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert torch_grouped.needs_alignment(x, w)
    xa, wa, width = torch_grouped.aligned(x, w)
    assert xa.shape[-1] % 8 == 0 and wa.shape[-1] % 8 == 0 and wa.shape[1] % 8 == 0 and width == n
    assert wa.transpose(1, 2).is_contiguous() == column_major
    out = torch._grouped_mm(xa, wa, offs=offs)[:, :width]
    out.float().sum().backward()
    got = (out.detach(), x.grad.clone(), stored.grad.clone())
    x.grad = stored.grad = None
    ref = torch.cat([xe @ we for xe, we in zip(x.split(counts), w, strict=True)])
    ref.float().sum().backward()
    for a, b in zip(got, (ref.detach(), x.grad, stored.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)  # bf16: per-expert mm vs grouped_mm order


def test_npu_permutations_are_wanted_where_the_npu_ops_are(monkeypatch) -> None:
    from hp_rewrite.kernels import npu_permute

    assert not npu_permute.wanted("npu", "cpu")  # torch_npu does not import in this process
    monkeypatch.setattr(npu_permute.npu, "available", lambda: True)
    assert npu_permute.wanted("npu", "cpu") and npu_permute.wanted("auto", "npu")
    assert not npu_permute.wanted("auto", "cpu") and not npu_permute.wanted("grouped", "npu")
    assert not npu_permute.wanted("eager", "npu")
