"""PEFT adapters on the experts of an expert-parallel model, saved and loaded as plain PEFT saves and
loads them; run inside the world of :func:`tests.engine_cases.peft_parity` (2 ranks, EP 2)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from hp_rewrite.loading.adapters import has_expert_adapters
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.runtime import installed
from hp_rewrite.tiny import build_tiny_model, tiny_config


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def expert_slicers(peft_ep, peft_ref) -> dict:
    """Parameter name of an adapter on the EP model's experts -> full tensor (``peft_ref``'s) -> this
    rank's part (the adapters of its local experts)."""
    from hp_rewrite.runtime.compute.experts import holder_of

    ref_modules = dict(peft_ref.named_modules())
    slicers = {}
    for name, module in peft_ep.named_modules():
        holder = holder_of(module)
        if holder is None or module is holder or not hasattr(module, "lora_A"):
            continue
        experts = list(installed.binding(holder).placement.local_experts)
        n_full = ref_modules[name].num_experts
        for adapter in module.lora_A:
            slicers[f"{name}.lora_A.{adapter}.weight"] = lambda t, e=experts, n=n_full: t.reshape(
                n, -1, t.shape[-1])[e].reshape(-1, t.shape[-1])
            slicers[f"{name}.lora_B.{adapter}.weight"] = lambda t, e=experts, n=n_full: t.reshape(
                t.shape[0], -1, n)[:, :, e].reshape(t.shape[0], -1)
    return slicers


@torch.no_grad()
def copy_local_adapters(peft_ep, peft_ref, slicers: dict) -> None:
    """The same adapters in both models: the EP model's expert adapters are this rank's rows of the
    full model's, every other adapter the full model's."""
    ref_params = dict(peft_ref.named_parameters())
    for name, p in peft_ep.named_parameters():
        if "lora_" in name:
            p.copy_(slicers[name](ref_params[name]) if name in slicers else ref_params[name])


def adapter_round_trip(rank: int, peft_ref, peft_ep, plan, out_dir: Path, mine: torch.Tensor,
                       before: Path, slicers: dict) -> dict:
    """``peft_ep.save_pretrained`` on every rank writes plain PEFT's files for the same adapters;
    plain ``PeftModel.from_pretrained`` of them gives the EP model's logits; an EP model loads plain
    PEFT's files (``from_pretrained``, ``load_adapter``, ``set_adapter``) and gives its logits.
    ``before``: plain PEFT's save of the same adapters before the training step (a second adapter);
    ``slicers``: parameter name -> this rank's part of a full tensor. After the training step the two
    models' adapters differ by the step's rounding (compared within the tolerance); this rank's part
    of what was saved is its own adapters exactly."""
    from peft import PeftModel

    out: dict = {}
    ref_sd, ep_sd = peft_ref.state_dict(), peft_ep.state_dict()  # the EP one: collective, full shapes
    lora = [k for k in ref_sd if "lora_" in k]
    out["state_dict_full"] = all(tuple(ep_sd[k].shape) == tuple(ref_sd[k].shape) for k in lora)
    out["state_dict_worst"] = max(_rel(ep_sd[k], ref_sd[k]) for k in lora)

    ep_dir, ref_dir = out_dir / "adapter_ep", out_dir / "adapter_ref"
    peft_ep.save_pretrained(ep_dir, is_main_process=rank == 0)  # on every rank: gathers, rank 0 writes
    if rank == 0:
        peft_ref.save_pretrained(ref_dir)
    dist.barrier()
    got, want = load_file(ep_dir / "adapter_model.safetensors"), load_file(ref_dir / "adapter_model.safetensors")
    out["file_keys"] = sorted(got) == sorted(want) and any(".experts." in k for k in want)
    out["file_shapes"] = all(got[k].shape == want[k].shape for k in want)
    out["file_worst"] = max(_rel(got[k], want[k]) for k in want)
    params = dict(peft_ep.named_parameters())
    out["file_local_exact"] = len(slicers) > 0 and all(
        torch.equal(cut(got[name.replace(".default.", ".")]), params[name].detach()) for name, cut in slicers.items())
    out["same_config"] = (json.loads((ep_dir / "adapter_config.json").read_text())
                          == json.loads((ref_dir / "adapter_config.json").read_text()))

    # what the EP run wrote, read by plain transformers + PEFT: the EP model's logits
    ep_logits = _logits(peft_ep, mine)
    plain = PeftModel.from_pretrained(build_tiny_model(tiny_config("qwen3_moe"), seed=0), ep_dir)
    out["plain_reads_ep"] = _rel(_logits(plain, mine), ep_logits)

    # what plain PEFT wrote, read by a fresh EP model: the plain model's logits, for each adapter
    fresh = rewrite_model(build_tiny_model(tiny_config("qwen3_moe"), seed=0), plan,
                          artifact_dir=out_dir / "art_fresh")
    loaded = PeftModel.from_pretrained(fresh, ref_dir)
    out["ep_reads_plain"] = _rel(_logits(loaded, mine), _logits(peft_ref, mine))
    # loaded frozen (PEFT's default): still expert adapters whose state dicts gather (prepare_trainer's test)
    out["frozen_counted"] = has_expert_adapters(loaded) and not any(
        p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n)
    # PEFT's low_cpu_mem_usage: the adapters are created on the meta device, then assigned
    lean = PeftModel.from_pretrained(rewrite_model(build_tiny_model(tiny_config("qwen3_moe"), seed=0), plan,
                                                   artifact_dir=out_dir / "art_fresh"), ref_dir, low_cpu_mem_usage=True)
    out["low_cpu_mem_usage"] = _rel(_logits(lean, mine), _logits(peft_ref, mine))
    loaded.load_adapter(before, adapter_name="before")
    loaded.set_adapter("before")
    plain_before = PeftModel.from_pretrained(build_tiny_model(tiny_config("qwen3_moe"), seed=0), before)
    out["second_adapter"] = _rel(_logits(loaded, mine), _logits(plain_before, mine))
    loaded.set_adapter("default")
    out["back_to_first"] = _rel(_logits(loaded, mine), _logits(peft_ref, mine))
    # both adapters in one state dict, full shapes, as plain PEFT with the same two adapters has them
    both = loaded.state_dict()
    twin = PeftModel.from_pretrained(build_tiny_model(tiny_config("qwen3_moe"), seed=0), ref_dir)
    twin.load_adapter(before, adapter_name="before")
    twin_sd = twin.state_dict()
    out["two_adapters_worst"] = max(_rel(both[k], twin_sd[k]) for k in twin_sd if "lora_" in k)
    out["ep_state_dict_exact"] = all(torch.equal(cut(ep_sd[name]), params[name].detach())
                                     for name, cut in slicers.items())
    out["two_adapters_keys"] = sorted(k for k in both if "lora_" in k) == sorted(k for k in twin_sd if "lora_" in k)
    # a full copy of the experts trained beside the adapters (modules_to_save): refused by name
    from peft import LoraConfig, get_peft_model

    copied = get_peft_model(rewrite_model(build_tiny_model(tiny_config("qwen3_moe"), seed=0), plan,
                                          artifact_dir=out_dir / "art_copied"),
                            LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["experts"]))
    try:
        copied.state_dict()
        out["modules_to_save_refused"] = ""
    except Exception as e:  # noqa: BLE001 (the message is what is checked)
        out["modules_to_save_refused"] = f"{type(e).__name__}: {e}"
    return out
