"""``runtime.fp8_gemm``: experts kept as block-FP8 codes multiply them with FP8 GEMMs (rows quantised per
128 columns, :mod:`hp_rewrite.kernels.fp8_gemm`). On the CPU the kernel is torch's documented block
arithmetic in fp32; the layouts handed to torch's CUDA kernel are checked against torch's own shape and
stride rules (its meta kernel). Against the decoded experts: the forward within the stated tolerance, dX
bit for bit (it goes through the decoded weights); every other expert weight is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hp_rewrite.kernels import fp8_gemm
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.loading.quantized import dequantize_fp8, quantize_fp8, quantize_mxfp4
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime.compute.quantized import QuantizedWeight
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.runtime.pipeline.layer import ExpertParallelBinding
from hp_rewrite.tiny import build_tiny_model, tiny_config

FORWARD_TOL = {torch.float32: 3e-2, torch.bfloat16: 4e-2}  # docs/checkpoints.md gives the measured errors
GRAD_TOL = {torch.float32: 1e-1, torch.bfloat16: 1e-1}


@pytest.mark.skipif(not hasattr(F, "scaled_mm"), reason="this torch has no torch.nn.functional.scaled_mm")
@pytest.mark.parametrize("rows,cols,out", [(1, 128, 256), (5, 384, 128), (17, 256, 384)])
def test_layouts_are_what_torchs_kernel_takes(rows, cols, out) -> None:
    """torch's meta kernel for ``scaled_mm`` holds the CUDA kernel's shape / stride rules (column-major
    1x128 scales, 128x128 scales padded to a multiple of 4 groups along ``in``)."""
    x = torch.empty(rows, cols, device="meta", dtype=torch.bfloat16)
    codes, scales = fp8_gemm.quantize_rows(x)
    weight = torch.empty(out, cols, device="meta", dtype=torch.float8_e4m3fn)
    weight_scale = fp8_gemm.weight_scales(torch.empty(out // 128, cols // 128, device="meta"))
    kinds = F.ScalingType
    y = F.scaled_mm(codes, weight.t(), scales, kinds.BlockWise1x128, weight_scale, kinds.BlockWise128x128,
                    output_dtype=torch.bfloat16)
    assert y.shape == (rows, out)
    if rows > 2:  # one expert's rows of a larger batch, its scales made column-major again
        part = fp8_gemm.row_slice(codes, scales, 1, rows - 1)
        assert F.scaled_mm(part[0], weight.t(), part[1], kinds.BlockWise1x128, weight_scale, kinds.BlockWise128x128,
                           output_dtype=torch.bfloat16).shape == (rows - 2, out)
    stacked = fp8_gemm.weight_scales(torch.empty(3, out // 128, cols // 128, device="meta"))
    assert stacked[1].shape == weight_scale.shape and stacked[1].stride() == weight_scale.stride()
    if rows > 1 and cols > 128:  # the rule is live: row-major scales are refused
        with pytest.raises(RuntimeError, match="stride"):
            F.scaled_mm(codes, weight.t(), scales.contiguous(), kinds.BlockWise1x128, weight_scale,
                        kinds.BlockWise128x128, output_dtype=torch.bfloat16)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_blockwise_product_is_the_block_formula(ue8m0) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 256, generator=g) * torch.logspace(-2, 1, 256)  # groups of very different ranges
    w = torch.randn(384, 256, generator=g) * 0.02
    codes_w, grid = quantize_fp8(w, (128, 128))
    if ue8m0:  # DeepSeek-V3.1 / Kimi-K2 style power-of-two scales, stored as exponents
        grid = (grid.log2().ceil() + 127).to(torch.uint8)
        codes_w = (w / (grid.float() - 127).exp2().repeat_interleave(128, 0).repeat_interleave(128, 1)).to(
            torch.float8_e4m3fn)
    codes, scales = fp8_gemm.quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.stride() == (1, 9)
    x_back = (codes.float().view(9, 2, 128) * scales.unsqueeze(-1)).view(9, 256)
    group_max = x.abs().view(9, 2, 128).amax(-1, keepdim=True).expand(9, 2, 128).reshape(9, 256)
    assert ((x_back - x).abs() <= group_max / 16 + 1e-30).all()  # e4m3: 3 mantissa bits, half a step
    want = x_back @ dequantize_fp8(codes_w, grid, (128, 128)).t()
    got = fp8_gemm.blockwise_mm(codes, scales, codes_w, fp8_gemm.weight_scales(grid), torch.float32)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


_ART = Path("/tmp/hp_rewrite_test_fp8_gemm")


def _kept_model(fp8: bool, method: str = "fp8", block=(128, 128), layers: int | None = None) -> nn.Module:
    """A tiny Qwen3-MoE (hidden 256, experts 128 wide: whole 128 x 128 blocks) rewritten at EP 1 with its
    experts kept as codes, ``runtime.fp8_gemm: fp8``; the same random weights every call."""
    config = tiny_config("qwen3_moe")
    config.hidden_size, config.moe_intermediate_size, config.num_experts = 256, 128, 4
    config.num_hidden_layers = layers or config.num_hidden_layers
    model = build_tiny_model(config, seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: 1\nruntime:\n  fp8_gemm: {str(fp8).lower()}\n")
    model = rewrite_model(model, plan, artifact_dir=_ART)
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(module, name).detach()
                if method == "mxfp4":
                    q = QuantizedWeight.mxfp4(*quantize_mxfp4(w), w.dtype, in_first=False)
                elif method == "fp8":
                    codes, grids = zip(*[quantize_fp8(w[e], block) for e in range(w.shape[0])], strict=True)
                    q = QuantizedWeight.fp8(torch.stack(codes), torch.stack(grids), block, w.dtype)
                else:  # left dense
                    continue
                setattr(module, name, nn.Parameter(q, requires_grad=False))
    for n, p in model.named_parameters():
        p.requires_grad_("experts" not in n)
    return model


def _lora_step(fp8: bool, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = get_peft_model(_kept_model(fp8), LoraConfig(
        r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().float(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_against_the_decoded_experts(dtype, monkeypatch) -> None:
    """LoRA on attention and on the kept experts: logits and every adapter gradient within the stated
    tolerance of the decoded experts (exactly the dequantised model), one FP8 GEMM per expert with rows."""
    calls = []
    real = fp8_gemm.blockwise_mm
    monkeypatch.setattr(fp8_gemm, "blockwise_mm", lambda c, *a: calls.append(c.shape[0]) or real(c, *a))
    logits8, grads8 = _lora_step(True, dtype)
    layers = tiny_config("qwen3_moe").num_hidden_layers
    assert sum(calls) == 2 * layers * 24 * tiny_config("qwen3_moe").num_experts_per_tok  # both projections' rows
    assert len(calls) <= 2 * layers * 4  # one GEMM per expert with rows
    calls.clear()
    logits, grads = _lora_step(False, dtype)
    assert not calls
    err = ((logits8 - logits).abs().max() / logits.abs().max()).item()
    assert 0 < err <= FORWARD_TOL[dtype], err  # rows quantised: close, not equal
    assert any(".experts." in n for n in grads) and any("q_proj" in n for n in grads)
    for n, g in grads.items():
        rel = ((grads8[n] - g).abs().max() / g.abs().max()).item()
        assert rel <= GRAD_TOL[dtype], (n, rel)


def test_fp8_gemm_dx_is_the_decoded_weights() -> None:
    """One projection: dX of the FP8 forward equals the decoded path's bit for bit."""
    from hp_rewrite.runtime.compute.quantized import QuantizedProjection, quantized_project

    weight = next(p for p in _kept_model(True).parameters() if isinstance(p, QuantizedWeight))
    counts = [5, 0, 7, 4]
    grads = []
    for fp8 in (True, False):
        x = torch.randn(16, weight.shape[-1], generator=torch.Generator().manual_seed(4)).requires_grad_()
        y = quantized_project(QuantizedProjection(weight, [], "w", fp8_gemm=fp8), x, lambda: counts, None, None, None)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(5)))
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("method,block,message", [
    ("mxfp4", (128, 128), r"runtime\.fp8_gemm: Qwen3MoeExperts\.gate_up_proj is kept as mxfp4"),
    ("fp8", (16, 16), "128 x 128 blocks only"),
    ("dense", (128, 128), "not kept as FP8 codes.*dequantize=False"),
])
def test_fp8_gemm_refuses_what_it_cannot_multiply(method, block, message) -> None:
    model = _kept_model(True, method, block)
    with pytest.raises(ExpertParallelError, match=message):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_zero_rows_quantise_to_zero_with_denormals_flushed() -> None:
    """The padding rows of empty groups are zeros: no 0 / 0, even where subnormal scales flush to zero."""
    flushed = torch.set_flush_denormal(True)
    try:
        codes, scales = fp8_gemm.quantize_rows(torch.zeros(3, 256))
    finally:
        torch.set_flush_denormal(False)
    assert codes.float().eq(0).all() and (scales > 0).all(), flushed


def test_fp8_gemm_is_the_calls_option(monkeypatch) -> None:
    """The call's binding's options decide, as for every other runtime option (the generated forward
    passes the holder's binding, with its plan options)."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hp_rewrite.runtime.binding.install import install_expert_parallel
    from hp_rewrite.runtime.group.groups import ExpertParallelGroup
    from hp_rewrite.runtime.options import RuntimeOptions
    from hp_rewrite.runtime.pipeline.dispatch import moe_forward

    holder = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=4))
    for name in ("gate_up_proj", "down_proj"):
        w = torch.randn(getattr(holder, name).shape) * 0.05
        codes, grids = zip(*[quantize_fp8(w[e], (128, 128)) for e in range(4)], strict=True)
        setattr(holder, name, nn.Parameter(QuantizedWeight.fp8(torch.stack(codes), torch.stack(grids), (128, 128),
                                                               torch.float32), requires_grad=False))
    install_expert_parallel(holder, num_experts=4, ep=ExpertParallelGroup.single())
    calls = []
    real = fp8_gemm.blockwise_mm
    monkeypatch.setattr(fp8_gemm, "blockwise_mm", lambda c, *a: calls.append(c.shape[0]) or real(c, *a))
    x, (weights, indices) = torch.randn(6, 256), torch.randn(6, 4).softmax(-1).topk(2, dim=-1)
    for fp8 in (False, True):
        moe_forward(x, indices, weights, holder, binding=ExpertParallelBinding.for_experts(
            4, ExpertParallelGroup.single(), RuntimeOptions(fp8_gemm=fp8)))
        assert bool(calls) == fp8


def test_fp8_gemm_runs_on_sm90_only() -> None:
    assert "sm90 only, this GPU is sm100" in fp8_gemm.fp8_gemm_problem(torch.device("cuda"), (128, 128), (256, 256), (10, 0))
    assert "not a multiple of 128" in fp8_gemm.fp8_gemm_problem(torch.device("cpu"), (128, 128), (256, 200))
    assert fp8_gemm.fp8_gemm_problem(torch.device("cuda"), (128, 128), (256, 256), (9, 0)) is None


def test_plan_field_is_typed_and_hashed() -> None:
    on = parse_plan("version: 1\nep_size: 2\nruntime:\n  fp8_gemm: true\n")
    off = parse_plan("version: 1\nep_size: 2\n")
    assert on.runtime.to_options().fp8_gemm and not off.runtime.to_options().fp8_gemm
    assert on.runtime.to_options().as_dict() != off.runtime.to_options().as_dict()


def test_fp8_gemm_under_torch_compile() -> None:
    """torch.compile of the PEFT model with FP8 GEMMs on the kept experts: the eager run's logits and
    adapter gradients within 1e-5 (the same arithmetic, compiled around the runtime's graph breaks)."""
    from peft import LoraConfig, get_peft_model

    runs = []
    for compiled in (False, True):
        torch.manual_seed(3)
        model = get_peft_model(_kept_model(True, layers=1), LoraConfig(
            r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
        # aot_eager: the graphs inductor would compile, traced in a fraction of the time (test_engines runs inductor)
        out = (torch.compile(model, backend="aot_eager") if compiled else model)(input_ids=ids, labels=ids)
        out.loss.backward()
        runs.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (want, want_grads), (got, got_grads) = runs
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    for n, g in want_grads.items():
        assert ((got_grads[n] - g).abs().max() / g.abs().max()).item() <= 1e-5, n
