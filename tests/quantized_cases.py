"""Quantised checkpoints in the Hub's layouts (MXFP4 gpt-oss, block-FP8 DeepSeek-V3 and Qwen3-MoE)
loaded expert-parallel on real gloo ranks, against plain transformers' dequantised load."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import hp_rewrite
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import installed
from hp_rewrite.tiny import as_bf16, build_tiny_model, tiny_config, write_quantized
from tests.engine_cases import lent_or_guests

# runtime.balance forced on (any imbalance, any piece moves): the kept experts' codes and adapters travel
BALANCED = "runtime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1}\n"

#: name -> (model type, format)
CHECKPOINTS = {"gpt_oss-mxfp4": ("gpt_oss", "mxfp4"), "deepseek_v3-fp8": ("deepseek_v3", "fp8"),
               "qwen3_moe-fp8": ("qwen3_moe", "fp8")}


def make_checkpoint(name: str, out: Path) -> Path:
    model_type, method = CHECKPOINTS[name]
    model = as_bf16(build_tiny_model(tiny_config(model_type), seed=0))
    model.save_pretrained(out)
    write_quantized(model, out, method, shards=3)
    return out


def plain(model_dir, **kwargs) -> torch.nn.Module:
    """What plain transformers loads (it dequantises on a CPU), every tensor in fresh storage."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
    for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values():
        t.data = t.data.clone()
    return model


def file_bytes(model_dir: Path, per_key: bool = False):
    """(every tensor's bytes, the expert tensors' bytes) in the checkpoint's files; ``per_key``: bytes by key."""
    from safetensors import safe_open

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    sizes = {}
    for key, file in index.items():
        with safe_open(model_dir / file, framework="pt") as f:
            s = f.get_slice(key)
            sizes[key] = torch.Size(s.get_shape()).numel() * {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}[s.get_dtype()]
    if per_key:
        return sizes
    return sum(sizes.values()), sum(n for k, n in sizes.items() if ".experts." in k)


def local_state(model) -> dict[str, torch.Tensor]:
    """Each expert weight of the EP model as the full tensor's rows it holds (to compare with a full model)."""
    out = {}
    for path, m in model.named_modules():
        binding = installed.binding(m)
        if binding is not None:
            for name in installed.layout(m).weight_names:
                out[f"{path}.{name}"] = binding.placement.local_index
    return out


def mismatches(model, full) -> list[str]:
    """Tensors of the EP model not bit-equal to the full model's (its local rows for expert weights)."""
    from torch.distributed.tensor import DTensor

    local, want_all, bad = local_state(model), full.state_dict(), []
    for name, tensor in model.state_dict().items():
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # fully_shard: collective
        want = want_all[name]
        if name in local:
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            want = installed.layout(owner).stored(installed.layout(owner).per_expert(want)[local[name]])
        if tensor.dtype != want.dtype or tensor.shape != want.shape or not torch.equal(tensor, want):
            bad.append(name)
    return bad


def step(full, ours, rank: int, world: int) -> dict:
    """One training forward and backward of this rank's share against the full model on the whole batch."""
    from hp_rewrite import sync_gradients
    from hp_rewrite.runtime.binding.install import expert_weights, local_rows

    for m in (full, ours):
        m.train()
        m.zero_grad(set_to_none=True)
    ids = torch.randint(0, 64, (2 * world, 6), generator=torch.Generator().manual_seed(3))
    mine = slice(2 * rank, 2 * rank + 2)
    theirs = full(input_ids=ids, labels=ids)
    theirs.loss.backward()
    out = ours(input_ids=ids[mine], labels=ids[mine])
    out.loss.backward()
    sync_gradients(ours)  # averaged over the world, as DDP: the full batch's mean
    weights = expert_weights(ours)
    grads = dict(full.named_parameters())
    worst = 0.0
    for n, p in ours.named_parameters():
        want = grads[n].grad
        want = local_rows(*weights[n], want) if n in weights else want
        worst = max(worst, ((p.grad - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
    logits = ((out.logits - theirs.logits[mine]).abs().max() / theirs.logits[mine].abs().max()).item()
    return {"logits_rel": logits, "grad_worst": worst}


def world_case(rank: int, world: int, payload: dict) -> dict:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    from hp_rewrite.loading.local import load_expert_parallel
    from hp_rewrite.runtime.group.groups import build_expert_parallel_group

    torch.set_num_threads(1)
    art = Path(payload["artifacts"])
    out = {}
    for name, model_dir in payload["checkpoints"].items():
        model_dir = Path(model_dir)
        full = plain(model_dir)
        r = out[name] = {}
        for ep_size in (2, world):
            plan = parse_plan(f"version: 1\nep_size: {ep_size}\n")
            if name.startswith("gpt_oss") and ep_size == world:  # transformers' own config, passed by the user
                with hp_rewrite.auto_patch(plan, artifact_dir=art):
                    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=Mxfp4Config(dequantize=True))
            elif name.startswith("deepseek") and ep_size == world:
                with hp_rewrite.auto_patch(plan, artifact_dir=art):
                    model = AutoModelForCausalLM.from_pretrained(
                        model_dir, quantization_config=FineGrainedFP8Config(dequantize=True))
            else:
                model = hp_rewrite.from_pretrained(model_dir, plan=plan, artifact_dir=art)
            direct, report = load_expert_parallel(model_dir, plan, build_expert_parallel_group(ep_size), art)
            r[f"ep{ep_size}"] = {
                "class": type(model).__name__, "dtype": str(model.dtype),
                "quantization_config": hasattr(model.config, "quantization_config"),
                "mismatched": mismatches(model, full), "direct_mismatched": mismatches(direct, full),
                "bytes_read": model.hp_rewrite.load_report["bytes_read"], "direct_bytes_read": report["bytes_read"],
                "format": report.get("quantization"),
            }
        # fp32: the dequantised values exactly, then one training step against the unmodified model
        plan = parse_plan(f"version: 1\nep_size: {world}\n")
        ours = hp_rewrite.from_pretrained(model_dir, plan=plan, artifact_dir=art, dtype=torch.float32)
        r["step"] = step(plain(model_dir, dtype=torch.float32), ours, rank, world)
        # resume: a distributed checkpoint after an optimizer step, loaded into a fresh load of the checkpoint
        torch.optim.SGD(ours.parameters(), lr=0.1).step()
        hp_rewrite.save_checkpoint(ours, None, Path(payload["saved"]) / f"{name}-dcp")
        fresh = hp_rewrite.from_pretrained(model_dir, plan=plan, artifact_dir=art, dtype=torch.float32)
        hp_rewrite.load_checkpoint(fresh, None, Path(payload["saved"]) / f"{name}-dcp")
        r["resume_mismatched"] = [n for n, t in fresh.state_dict().items() if not torch.equal(t, ours.state_dict()[n])]
        # load_fully_sharded: each rank reads and dequantises its shards only
        r["sharded_mismatched"] = mismatches(hp_rewrite.load_fully_sharded(model_dir, plan, artifact_dir=art), full)
        # saving writes the plain dequantised checkpoint, which plain transformers loads back
        saved = Path(payload["saved"]) / name
        model.save_pretrained(saved)
        if rank == 0:
            config = json.loads((saved / "config.json").read_text())
            again = plain(saved)
            r["saved"] = {"quantization_config": "quantization_config" in config,
                          "mismatched": [k for k, v in full.state_dict().items()
                                         if not torch.equal(v, again.state_dict()[k])],
                          "dtype": str(again.dtype)}
    out["kept"] = kept_case(rank, world, payload)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _kept_under_fsdp2(kept, peft_ref, config: dict, ids: torch.Tensor, mine: slice) -> dict:
    """hp_rewrite.fully_shard of a PEFT model on kept experts (``kept``: at EP 2 over 4 ranks, so the
    expert adapters are sharded over 2 expert replicas): the codes left as they are, the adapters and the
    rest sharded; one SGD step from ``peft_ref``'s adapters, against it on the whole batch."""
    from peft import get_peft_model

    from hp_rewrite.runtime.compute.quantized import QuantizedWeight
    from tests.fsdp_cases import _full
    from tests.peft_cases import copy_local_adapters, expert_slicers

    peft_fs = get_peft_model(kept, type(peft_ref.peft_config["default"])(**config))
    slicers = expert_slicers(peft_fs, peft_ref)
    copy_local_adapters(peft_fs, peft_ref, slicers)
    hp_rewrite.fully_shard(peft_fs)
    peft_ref.zero_grad()
    peft_ref(input_ids=ids, labels=ids).loss.backward()
    peft_fs(input_ids=ids[mine], labels=ids[mine]).loss.backward()
    moved = lent_or_guests(peft_fs)
    ref_params = dict(peft_ref.named_parameters())
    trainable = {n: p for n, p in peft_fs.named_parameters() if p.requires_grad}

    def worst(get) -> float:
        return max(_rel(_full(get(p)), slicers.get(n, lambda t: t)(get(ref_params[n]))) for n, p in trainable.items())

    out = {"fsdp_grad_worst": worst(lambda p: p.grad), "fsdp_lent_or_guests": moved}
    for m in (peft_ref, peft_fs):
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5).step()
    out["fsdp_step_worst"] = worst(lambda p: p.detach())
    out["fsdp_codes_kept"] = sum(isinstance(p, QuantizedWeight) for p in peft_fs.parameters())
    out["fsdp_adapters_sharded"] = all(hasattr(p, "device_mesh") for p in trainable.values())
    expert_adapter = next(p for n, p in trainable.items() if n in slicers)
    out["fsdp_expert_adapter_mesh"] = expert_adapter.device_mesh.size()
    return out


def kept_case(rank: int, world: int, payload: dict) -> dict:
    """Experts kept as the checkpoint's codes and scales (``dequantize=False``), fp32, at EP = world: each
    expert weight a QuantizedWeight whose decoded values are bit-equal to the dequantised model's local
    rows, resident expert bytes = the stored bytes of this rank's share; LoRA on attention and on the
    kept experts against plain PEFT on the dequantised unmodified model with the same adapters (forward,
    every adapter gradient, one SGD step); the adapter saved as plain PEFT saves it; merging into the
    kept weights and training them refused by name."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    from hp_rewrite.runtime.compute.experts import holder_of
    from hp_rewrite.runtime.compute.quantized import QuantizedWeight

    torch.set_num_threads(1)
    art, out = Path(payload["artifacts"]), {}
    plan = parse_plan(f"version: 1\nep_size: {world}\n{BALANCED}")
    for name, model_dir in payload["checkpoints"].items():
        model_dir, r = Path(model_dir), {}
        out[name] = r

        def load_kept(name=name, model_dir=model_dir, plan=plan):
            if name.startswith("gpt_oss"):  # as a gpt-oss recipe writes it, under auto_patch
                with hp_rewrite.auto_patch(plan, artifact_dir=art):
                    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                quantization_config=Mxfp4Config(dequantize=False))
            return hp_rewrite.from_pretrained(model_dir, plan=plan, artifact_dir=art, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=False))

        kept = load_kept()
        full = plain(model_dir, dtype=torch.float32).train()
        kept.train()
        want, local = full.state_dict(), local_state(kept)
        weights = {n: p for n, p in kept.named_parameters() if n in local and not n.endswith("_bias")}
        r["kept"] = sum(isinstance(p, QuantizedWeight) and not p.requires_grad for p in weights.values())
        r["expert_weights"] = len(weights)
        r["decoded_mismatched"] = []
        for n, p in weights.items():
            owner = kept.get_submodule(n.rsplit(".", 1)[0])
            if not torch.equal(p.dense(), installed.layout(owner).per_expert(want[n])[local[n]]):
                r["decoded_mismatched"].append(n)
        r["expert_bytes"] = kept.hp_rewrite.load_report["expert_bytes"]
        r["stored_share"] = sum(p.stored_bytes for p in weights.values())
        # a full save decodes the kept experts: the checkpoint the dequantised model saves
        kept.save_pretrained(art / f"kept-full-{name}")
        if rank == 0:
            again = plain(art / f"kept-full-{name}", dtype=torch.float32).state_dict()
            r["saved_mismatched"] = [k for k, v in want.items() if not torch.equal(v, again[k])]

        config = dict(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj", "q_b_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        torch.manual_seed(3)
        peft_ref = get_peft_model(full, LoraConfig(**config))
        torch.manual_seed(3)
        peft_ep = get_peft_model(kept, LoraConfig(**config))
        slicers, ref_modules = {}, dict(peft_ref.named_modules())
        for path, module in peft_ep.named_modules():
            holder = holder_of(module)
            if holder is None or module is holder or not hasattr(module, "lora_A"):
                continue
            experts, n_full = list(installed.binding(holder).placement.local_experts), ref_modules[path].num_experts
            slicers[f"{path}.lora_A.default.weight"] = lambda t, e=experts, n=n_full: t.reshape(
                n, -1, t.shape[-1])[e].reshape(-1, t.shape[-1])
            slicers[f"{path}.lora_B.default.weight"] = lambda t, e=experts, n=n_full: t.reshape(
                t.shape[0], -1, n)[:, :, e].reshape(t.shape[0], -1)
        ref_params = dict(peft_ref.named_parameters())
        with torch.no_grad():  # every adapter the reference's (its attention ones too: PEFT's draw order varies)
            for n, p in peft_ep.named_parameters():
                if p.requires_grad:
                    p.copy_(slicers.get(n, lambda t: t)(ref_params[n]))
        ids = torch.randint(0, 64, (2 * world, 6), generator=torch.Generator().manual_seed(5))
        mine = slice(2 * rank, 2 * rank + 2)
        theirs = peft_ref(input_ids=ids, labels=ids)
        ddp = DDP(peft_ep)  # as Trainer wraps it (held: its hooks reduce in the backward)
        ours = ddp(input_ids=ids[mine], labels=ids[mine])
        r["logits_rel"] = _rel(ours.logits, theirs.logits[mine])
        r["lent_or_guests"] = lent_or_guests(peft_ep)  # runtime.balance: the codes and adapters travelled
        # bytes a lent expert sent (all layers), against its dequantised weights (fp32 here)
        stats = [st for _, h in installed.holders(peft_ep) if (st := installed.last_stats(h)) is not None and st.lent]
        dense = next(m for m in full.modules() if type(m).__name__.endswith("Experts"))
        r["lent_bytes"] = [st.lent_bytes / st.lent for st in stats]
        r["dense_bytes"] = sum(p[0].numel() * p.element_size() for p in dense.parameters())
        theirs.loss.backward()
        ours.loss.backward()
        trainable = [n for n, p in peft_ep.named_parameters() if p.requires_grad]
        r["trainable"], r["expert_adapters"] = len(trainable), len(slicers)

        def worst(get, peft_ep=peft_ep, ref_params=ref_params, slicers=slicers, trainable=trainable) -> float:
            return max(_rel(get(p), slicers.get(n, lambda t: t)(get(ref_params[n])))
                       for n, p in peft_ep.named_parameters() if n in trainable)

        r["grad_worst"] = worst(lambda p: p.grad)
        for m in (peft_ref, peft_ep):
            torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5).step()
        r["step_worst"] = worst(lambda p: p.detach())
        del ddp
        # the adapter, saved on every rank, is plain PEFT's; plain PEFT on the dequantised model reads it
        saved = art / f"kept-{name}"
        peft_ep.save_pretrained(saved, is_main_process=rank == 0)
        import torch.distributed as dist

        dist.barrier()
        with torch.no_grad():
            again = PeftModel.from_pretrained(plain(model_dir, dtype=torch.float32), saved)
            r["plain_reads_adapter"] = _rel(again(input_ids=ids[mine]).logits, peft_ep(input_ids=ids[mine]).logits)
        try:
            peft_ep.merge_and_unload()
            r["merge_refused"] = ""
        except Exception as e:  # noqa: BLE001 (the message is what is checked)
            r["merge_refused"] = str(e)
        try:
            hp_rewrite.save_checkpoint(kept, None, art / f"kept-dcp-{name}")
            r["dcp_refused"] = ""
        except Exception as e:  # noqa: BLE001
            r["dcp_refused"] = str(e)
        r.update(_kept_under_fsdp2(load_kept(plan=parse_plan(f"version: 1\nep_size: 2\n{BALANCED}")), peft_ref, config,
                                   ids, mine))
        holder = next(m for m in kept.modules() if installed.binding(m) is not None)
        weight = next(n for n in ("gate_up_proj", "down_proj") if isinstance(getattr(holder, n, None), QuantizedWeight))
        getattr(holder, weight).requires_grad_(True)
        try:
            kept(input_ids=ids[mine])
            r["training_refused"] = ""
        except Exception as e:  # noqa: BLE001
            r["training_refused"] = str(e)
    return out
