"""Experts kept as MXFP4 / block-FP8 codes (:mod:`hp_rewrite.runtime.compute.quantized`), in one process: the
device decoders equal the loader's (transformers' values) bit for bit; a kept weight decoded a bounded
chunk of experts at a time gives the dequantised model's forward and every LoRA gradient (fp32, 1e-5),
keeps no decoded copy for the backward, and refuses writes and training by name. Loading kept
checkpoints at EP 2 and 4 runs in the world of ``test_quantized_load`` (``quantized_cases.kept_case``)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from hp_rewrite.kernels.dequant import decode_fp8, decode_mxfp4
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.loading.quantized import dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime.compute.quantized import QuantizedWeight
from hp_rewrite.runtime.errors import ExpertParallelError
from hp_rewrite.tiny import build_tiny_model, tiny_config

TOL = 1e-5


def test_device_decoders_equal_the_loaders() -> None:
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=g)  # every code pair
    scales = torch.randint(100, 140, (3, 8, 2), dtype=torch.uint8, generator=g)
    assert torch.equal(decode_mxfp4(blocks, scales), dequantize_mxfp4(blocks, scales))
    w = torch.randn(2, 13, 10, generator=g)
    codes, grids = zip(*[quantize_fp8(w[e], (8, 4)) for e in range(2)], strict=True)
    want = torch.stack([dequantize_fp8(c, s, (8, 4)) for c, s in zip(codes, grids, strict=True)])
    assert torch.equal(decode_fp8(torch.stack(codes), torch.stack(grids), (8, 4)), want)
    exponents = torch.tensor([[[120, 127, 130], [5, 140, 127]]], dtype=torch.uint8)  # UE8M0 scales
    assert torch.equal(decode_fp8(codes[0][None], exponents, (8, 4))[0], dequantize_fp8(codes[0], exponents[0], (8, 4)))


def _kept_pair(family: str, chunk_mb: str = "0.000001") -> tuple[nn.Module, nn.Module]:
    """(the model with its expert weights replaced by their dequantised values, the EP=1 rewrite of it
    with those weights kept as codes)."""
    ref = build_tiny_model(tiny_config(family), seed=0).train()
    kept = {}
    for name, module in ref.named_modules():
        if type(module).__name__.endswith("Experts"):
            for attr in ("gate_up_proj", "down_proj"):
                w = getattr(module, attr).detach()
                if family == "gpt_oss":  # in-first [E, in, out], stored out-first
                    q = QuantizedWeight.mxfp4(*quantize_mxfp4(w.transpose(1, 2)), w.dtype)
                else:
                    codes, grids = zip(*[quantize_fp8(w[e], (16, 16)) for e in range(w.shape[0])], strict=True)
                    q = QuantizedWeight.fp8(torch.stack(codes), torch.stack(grids), (16, 16), w.dtype)
                with torch.no_grad():
                    getattr(module, attr).copy_(q.dense())
                kept[f"{name}.{attr}"] = q
    # by default the plan's runtime.dequant_chunk_mb at its smallest: one expert decoded at a time
    plan = parse_plan(f"version: 1\nep_size: 1\nruntime:\n  dequant_chunk_mb: {chunk_mb}\n")
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=_ART)
    for full, q in kept.items():
        holder, _, attr = full.rpartition(".")
        setattr(model.get_submodule(holder), attr, nn.Parameter(q, requires_grad=False))
    for m in (ref, model):
        for n, p in m.named_parameters():
            p.requires_grad_("experts" not in n)
    return ref, model


_ART = Path("/tmp/hp_rewrite_test_kept")


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "qwen3_moe"])
def test_lora_on_kept_experts_equals_the_dequantised_model(family, monkeypatch) -> None:
    from peft import LoraConfig, get_peft_model

    ref, model = _kept_pair(family)
    config = dict(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj", "q_b_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    torch.manual_seed(3)
    peft_ref = get_peft_model(ref, LoraConfig(**config))
    torch.manual_seed(3)
    peft_kept = get_peft_model(model, LoraConfig(**config))
    decoded, saved = [], []
    real_decode = QuantizedWeight.decode
    monkeypatch.setattr(QuantizedWeight, "decode", lambda self, a, b, dtype=None: (
        decoded.append(b - a), real_decode(self, a, b, dtype))[1])
    monkeypatch.setattr(QuantizedWeight, "dense", lambda self: pytest.fail("a kept weight was decoded whole"))
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
    want = peft_ref(input_ids=ids, labels=ids)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
        got = peft_kept(input_ids=ids, labels=ids)
    assert ((got.logits - want.logits).abs().max() / want.logits.abs().max()).item() <= TOL
    want.loss.backward()
    got.loss.backward()
    trained = dict(peft_ref.named_parameters())
    names = [n for n, p in peft_kept.named_parameters() if p.requires_grad]
    assert any(".experts." in n for n in names) and any("_proj.lora" in n and ".experts." not in n for n in names)
    for n in names:
        g, w = dict(peft_kept.named_parameters())[n].grad, trained[n].grad
        assert ((g - w).abs().max() / w.abs().max()).item() <= TOL, n
    assert decoded and set(decoded) == {1}  # forward and backward: one expert at a time
    dims = {tuple(sorted(q.shape[1:])) for q in (p for p in model.parameters() if isinstance(p, QuantizedWeight))}
    assert not [s for s in saved if len(s) == 3 and tuple(sorted(s[1:])) in dims]  # no decoded weight kept


def test_one_chunk_needs_no_host_counts_and_several_adapters_are_refused_undecoded(monkeypatch) -> None:
    """All local experts in one chunk (the default 64 MiB here): one grouped GEMM over the device offsets,
    no host read of the split sizes at EP 1; two adapters active at once on a kept weight (PEFT's dense
    delta) refused by name before anything is decoded whole."""
    from peft import LoraConfig, get_peft_model

    from hp_rewrite.runtime.compute.batch import LocalBatch

    ref, model = _kept_pair("qwen3_moe", chunk_mb="64")
    reads = []
    real = LocalBatch.counts
    monkeypatch.setattr(LocalBatch, "counts", property(lambda self: (reads.append(1), real.fget(self))[1]))
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
    want, got = ref(input_ids=ids).logits, model(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= TOL and reads == []
    config = dict(r=2, lora_alpha=4, init_lora_weights=False, target_parameters=["mlp.experts.gate_up_proj"])
    peft = get_peft_model(model, LoraConfig(**config))
    peft.add_adapter("second", LoraConfig(**config))
    peft.base_model.set_adapter(["default", "second"])
    monkeypatch.setattr(QuantizedWeight, "dense", lambda self: pytest.fail("a kept weight was decoded whole"))
    with pytest.raises(ExpertParallelError, match="only one LoRA adapter at a time"):
        peft(input_ids=ids)


def test_kept_weight_is_a_frozen_parameter_that_refuses_writes() -> None:
    w = torch.randn(2, 64, 32)
    q = QuantizedWeight.mxfp4(*quantize_mxfp4(w.transpose(1, 2)), torch.float32)
    p = nn.Parameter(q, requires_grad=False)
    assert isinstance(p, QuantizedWeight) and isinstance(p, nn.Parameter) and p.shape == w.shape
    assert isinstance(p.detach(), QuantizedWeight) and p.to(torch.bfloat16).dtype == torch.bfloat16
    assert isinstance(p.to(torch.bfloat16), QuantizedWeight) and p.stored_bytes == 2 * 32 * 2 * 17
    assert torch.equal(p * 2, p.dense() * 2)  # any other op sees the dense values
    with pytest.raises(ExpertParallelError, match="kept quantised"):
        with torch.no_grad():
            p.add_(1.0)
    with pytest.raises(ExpertParallelError, match="kept quantised"):
        p.data.copy_(w)
    with pytest.raises(ExpertParallelError, match="kept quantised"):  # an optimizer's foreach step
        torch._foreach_add_([p], 1.0)
    with pytest.raises(ExpertParallelError, match="a view of an expert weight kept quantised"):
        p[0].zero_()  # a view could not write back
    assert p.dense().view(-1).shape == (w.numel(),)  # the decoded values are contiguous
    assert "QuantizedWeight(mxfp4" in repr(p)


def test_kept_experts_under_bf16_autocast_and_torch_compile() -> None:
    """bf16 autocast over fp32 kept weights: within 3e-2 of the dequantised model under the same
    autocast; torch.compile of the PEFT model (LoRA on the kept experts): forward and every adapter
    gradient within 1e-5 of the uncompiled dequantised model."""
    from peft import LoraConfig, get_peft_model

    ref, model = _kept_pair("gpt_oss")
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = ref(input_ids=ids).logits.float(), model(input_ids=ids).logits
    assert got.dtype == torch.bfloat16 and ((got.float() - want).abs().max() / want.abs().max()).item() <= 3e-2
    config = dict(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    torch.manual_seed(3)
    peft_ref = get_peft_model(ref, LoraConfig(**config))
    torch.manual_seed(3)
    peft_kept = get_peft_model(model, LoraConfig(**config))
    want = peft_ref(input_ids=ids, labels=ids)
    got = torch.compile(peft_kept, backend="aot_eager")(input_ids=ids, labels=ids)  # inductor: test_engines
    assert ((got.logits - want.logits).abs().max() / want.logits.abs().max()).item() <= TOL
    want.loss.backward()
    got.loss.backward()
    trained = dict(peft_ref.named_parameters())
    for n, p in peft_kept.named_parameters():
        if p.requires_grad:
            assert ((p.grad - trained[n].grad).abs().max() / trained[n].grad.abs().max()).item() <= TOL, n


def test_kept_by_default_only_where_transformers_keeps_and_said(tmp_path, monkeypatch) -> None:
    """No quantization_config passed: the experts stay codes only where transformers itself would keep
    the checkpoint quantised (never on this CPU), and then a warning says they load frozen and how to
    train them; dequantize=False passed: kept, silently; dequantize=True: dequantised."""
    import warnings

    from transformers import FineGrainedFP8Config

    from hp_rewrite.loading import pretrained
    from tests.quantized_cases import make_checkpoint

    checkpoint = make_checkpoint("qwen3_moe-fp8", tmp_path / "fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kwargs, keep = pretrained.dequantize_at_load(checkpoint, {})
        assert not keep and kwargs["quantization_config"].dequantize
        assert pretrained.dequantize_at_load(
            checkpoint, {"quantization_config": FineGrainedFP8Config(dequantize=False)})[1]
        assert not pretrained.dequantize_at_load(
            checkpoint, {"quantization_config": FineGrainedFP8Config(dequantize=True)})[1]
    monkeypatch.setattr(pretrained, "transformers_keeps", lambda stored: True)  # a GPU machine
    with pytest.warns(UserWarning, match=r"load frozen.*FineGrainedFP8Config\(dequantize=True\)"):
        assert pretrained.dequantize_at_load(checkpoint, {})[1]
