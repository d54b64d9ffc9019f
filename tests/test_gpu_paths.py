"""What runs on a GPU, checked on CPU: the kernel choice by device capability, the grouped path under
autocast with fp32 weights, the fixed-order sums and the packed side values of runtime/transport/rows.py.

The multi-rank parts (one host read per layer, one all-to-all per direction, the layer's autograd
graph) are in test_rewrite.py and test_ep_parity.py, in their worlds."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hp_rewrite.kernels import KernelProblem, choose
from hp_rewrite.runtime.binding.install import install_expert_parallel
from hp_rewrite.runtime.group.groups import ExpertParallelGroup
from hp_rewrite.runtime.options import RuntimeOptions
from hp_rewrite.runtime.transport.rows import copy_table, fixed_order_sum, gather_rows, pack_rows, unpack_rows
from tests.ep_cases import BF16_TOL, E, H, _rel, build_block, ep_forward, reference_forward


@pytest.mark.parametrize(("capability", "auto", "note"), [((8, 0), "eager", "sm80"), ((9, 0), "grouped", None),
                                                          ((10, 0), "grouped", None), ((12, 0), "eager", "sm120")])
def test_auto_takes_grouped_mm_where_it_has_a_grouped_kernel(monkeypatch, capability, auto, note) -> None:
    """Outside sm90 / sm100 torch's grouped_mm syncs the host at every call: auto takes the per-expert loop there,
    whose split sizes the host already holds; an explicit request still gets grouped_mm, told why."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    problem = KernelProblem("cuda", torch.bfloat16, 16, (2048, 768), torch.bfloat16)
    chosen = choose("auto", problem)
    assert chosen.backend == auto and (note is None or note in chosen.reason), chosen
    asked = choose("grouped", problem)
    assert asked.backend == "grouped" and (note is None or "stream sync" in asked.reason), asked
    assert choose("auto", KernelProblem("cuda", torch.float32, 16, (64,), torch.float32)).backend == "eager"


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "gpt_oss"])
def test_grouped_path_under_autocast_with_fp32_weights(monkeypatch, family: str) -> None:
    """Trainer bf16=True on an fp32 model: the experts still run grouped_mm, in bf16, and match the
    unmodified block under the same autocast within bf16 error (forward and every gradient)."""
    calls = []
    grouped = F.grouped_mm

    def counting(x, w, *args, **kwargs):
        calls.append((x.dtype, w.dtype))
        return grouped(x, w, *args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", counting)
    ref = build_block(family)
    blk = copy.deepcopy(ref)
    for m in blk.modules():  # the reference runs transformers' eager loop; here transformers' default
        if isinstance(getattr(getattr(m, "config", None), "_experts_implementation", None), str):
            m.config._experts_implementation = "grouped_mm"
    opts = RuntimeOptions()
    install_expert_parallel(blk.experts, num_experts=E, ep=ExpertParallelGroup.single(), options=opts)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(0))
    x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = reference_forward(family, ref, x_ref)
        out = ep_forward(family, blk, x_ep, ExpertParallelGroup.single(), opts)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (ref_out.float() * g).sum().backward()
    (out.float() * g).sum().backward()
    assert calls and all(dt == (torch.bfloat16, torch.bfloat16) for dt in calls), calls
    assert _rel(out, ref_out) <= BF16_TOL and _rel(x_ep.grad, x_ref.grad) <= BF16_TOL
    ref_params = dict(ref.named_parameters())
    for name, p in blk.named_parameters():
        if p.grad is not None or ref_params[name].grad is not None:
            assert p.dtype == torch.float32 and _rel(p.grad, ref_params[name].grad) <= BF16_TOL, name


def test_fixed_order_sums_equal_index_add() -> None:
    """A gather's fixed-order backward and the weighted per-row sum give index_add_'s values (float64)."""
    gen = torch.Generator().manual_seed(0)
    n, k, h = 7, 3, 5
    src = torch.randn(n, h, dtype=torch.float64, generator=gen, requires_grad=True)
    slots = torch.randperm(n * k, generator=gen)[:15]  # a token's copies, some slots dropped
    out = gather_rows(src, torch.div(slots, k, rounding_mode="floor"), copy_table(slots, n, k))
    g = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    out.backward(g)
    want = torch.zeros_like(src).index_add_(0, torch.div(slots, k, rounding_mode="floor"), g)
    torch.testing.assert_close(src.grad, want, rtol=0, atol=1e-12)
    w = torch.randn(15, dtype=torch.float64, generator=gen)
    summed = fixed_order_sum(g, copy_table(slots, n, k), w)
    torch.testing.assert_close(summed, torch.zeros(n, h, dtype=torch.float64).index_add_(
        0, torch.div(slots, k, rounding_mode="floor"), g * w.unsqueeze(1)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_packed_side_values_travel_bit_for_bit(hidden_dtype, weights_dtype) -> None:
    """Weights, ids and the weights' gradient come back out of the hidden-dtype rows bit for bit (odd K,
    a NaN weight included), through a float round trip of the packed rows (what a compiled copy may do),
    and the packed rows hold no NaN of their own (anomaly mode checks every backward output)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen).to(hidden_dtype).requires_grad_()
    w = torch.randn(6, 3, generator=gen).to(weights_dtype)
    w[0, 0] = float("nan")
    w.requires_grad_()
    ids = torch.randint(-1, 300, (6, 3), generator=gen)
    packed = pack_rows(x, w, ids)
    assert packed.dtype == hidden_dtype and not packed[:, 8:].isnan().any()
    x2, w2, ids2 = unpack_rows(packed.float().to(hidden_dtype), 8, weights_dtype, 3)
    one = unpack_rows(packed[2:3], 8, weights_dtype, 3)  # one row: a slice whose row stride is not the width
    assert torch.equal(one[1].view(torch.uint8), w[2:3].detach().view(torch.uint8))
    assert torch.equal(x2, x.detach()) and torch.equal(ids2.long(), ids)
    assert torch.equal(w2.view(torch.uint8), w.detach().view(torch.uint8))
    gw = torch.randn(6, 3, generator=gen).to(weights_dtype)
    gx = torch.randn(6, 8, generator=gen).to(hidden_dtype)
    with torch.autograd.detect_anomaly():
        (x2.float() * gx.float()).sum().add((w2.float().nan_to_num() * gw.float()).sum()).backward()
    assert torch.equal(x.grad, gx) and torch.equal(w.grad[1:], gw[1:])


@pytest.mark.parametrize("known", [False, True])
def test_padded_groups_give_the_same_rows_and_gradients(known: bool) -> None:
    """Empty expert groups padded with zero rows (every group at ep 1 on CUDA, the empty ones where the
    host has the counts): the real rows' outputs and every gradient as without padding."""
    from hp_rewrite.runtime.binding.install import install_expert_parallel
    from hp_rewrite.runtime.compute.batch import LocalBatch, pad_empty_groups
    from hp_rewrite.runtime.compute.experts import local_experts_forward
    from hp_rewrite.runtime.group.groups import ExpertParallelGroup

    blk = build_block("qwen3")
    install_expert_parallel(blk.experts, num_experts=E, ep=ExpertParallelGroup.single(), options=RuntimeOptions())
    counts = [3, 0, 2, 0, 0, 4, 1, 0]
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(0))
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    outs, grads = [], []
    for pad in (False, True):
        xi = x.clone().requires_grad_()
        batch = LocalBatch(xi, counts if known else None, offsets)
        if pad:
            padded, positions = pad_empty_groups(batch, always=True)
            assert pad_empty_groups(padded, always=True) is None  # never padded twice (ep 1 on CUDA recurses)
            assert padded.hidden.shape[0] == x.shape[0] + (counts.count(0) if known else len(counts))
            out = local_experts_forward(blk.experts, padded).index_select(0, positions)
        else:
            out = local_experts_forward(blk.experts, batch)
        out.pow(2).sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad.clone() for p in blk.experts.parameters()])
        blk.experts.zero_grad(set_to_none=True)
    assert _rel(outs[1], outs[0]) <= 1e-6  # the zero rows change the dW GEMMs' summation order only
    assert all(_rel(a, b) <= 1e-5 for a, b in zip(grads[1], grads[0], strict=True))
