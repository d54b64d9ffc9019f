"""``checkpoint_weights`` (#46) on every rank of a real gloo world: for each family's checkpoint in its
Hub layout, what the expert-parallel model streams (to every rank, and to one) is name for name and bit
for bit what plain transformers' ``save_pretrained`` writes for the unmodified model; expert rows travel
in buckets (no gather over ``bucket_size`` at the receiver, several per layer); a PEFT model streams the
merged weights of plain PEFT's ``merge_and_unload`` and is left as it was."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

from hp_rewrite import auto_patch, checkpoint_weights
from hp_rewrite.hf import quiet_transformers
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import installed

from .vllm_standin import vllm_name_problems

#: the plan's weight_sync_bucket_mb here: small enough that a tiny layer's experts take several buckets
BUCKET_MB = 2**-8  # 4 KiB


@contextlib.contextmanager
def gathered_bytes():
    """The bytes each all-gather / gather brought to this rank (a list filled while the block runs)."""
    sizes, gather, all_gather = [], dist.gather, dist.all_gather_into_tensor

    def counted_all_gather(out, piece, *args, **kwargs):
        sizes.append(out.numel() * out.element_size())
        return all_gather(out, piece, *args, **kwargs)

    def counted_gather(piece, parts=None, *args, **kwargs):
        if parts is not None:
            sizes.append(piece.numel() * piece.element_size() * len(parts))
        return gather(piece, parts, *args, **kwargs)

    dist.all_gather_into_tensor, dist.gather = counted_all_gather, counted_gather
    try:
        yield sizes
    finally:
        dist.all_gather_into_tensor, dist.gather = all_gather, gather


def plain_files(model, directory: Path) -> dict[str, torch.Tensor]:
    """What transformers' ``save_pretrained`` writes for ``model`` (one file: tiny models); in a world
    it writes on rank 0 only, the same model on every rank."""
    with quiet_transformers():
        model.save_pretrained(directory)
    dist.barrier()
    return load_file(directory / "model.safetensors")


#: a merged weight (the base plus the LoRA delta) of a sharded model against plain PEFT's merge_and_unload: the
#: delta is two programs' (PEFT's product of this rank's expert adapters or of FSDP2's shards against the whole
#: one), so each entry within rounding of its own value: fp32 a few roundings, bf16 one rounding step (2**-7 of
#: the value), entries near zero to rounding of the tensor's largest. A delta left out, misplaced or mis-scaled
#: is off by far more (0.65 of the largest left out at EP 2, bf16). Everything else bit for bit
MERGED_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _same(t: torch.Tensor, want: torch.Tensor, merged: bool) -> bool:
    if not merged:
        return torch.equal(t, want)
    floor = 1e-6 * want.float().abs().max().item()
    return torch.allclose(t.float(), want.float(), rtol=MERGED_RTOL[want.dtype], atol=floor)


def compare(streamed: list, want: dict[str, torch.Tensor], where: str, merged: tuple[str, ...] = ()) -> list[str]:
    """Problems of ``streamed`` (name, tensor) pairs against the files' tensors; names containing one of
    ``merged`` are merged weights (:data:`MERGED_RTOL`)."""
    names = [n for n, _ in streamed]
    if len(set(names)) != len(names):
        return [f"{where}: names yielded twice"]
    if set(names) != set(want):
        return [f"{where}: names {sorted(set(names) ^ set(want))[:6]} differ from save_pretrained's"]
    return [f"{where}: {n} differs" for n, t in streamed if t.dtype != want[n].dtype or t.shape != want[n].shape
            or not _same(t.cpu(), want[n], any(part in n for part in merged))]


def stream_problems(ours, want: dict, where: str, rank: int, world: int, family: str | None = None,
                    merged: tuple[str, ...] = ()) -> list[str]:
    """Every rank receiving, then only the last rank; no gather over the plan's bucket (or one expert of
    each rank), and several per layer where the bucket is smaller than a layer's experts; for a family
    vLLM serves, names its loader takes (tests/vllm_standin.py). ``merged``: as :func:`compare`'s."""
    with gathered_bytes() as sizes:
        streamed = list(checkpoint_weights(ours))
    problems = compare(streamed, want, f"{where} dst=None", merged)
    holders = [m for m in ours.modules() if installed.binding(m) is not None]
    if family in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
        problems += vllm_name_problems(family, streamed, installed.binding(holders[0]).placement.num_experts)
    if holders and installed.binding(holders[0]).ep.size > 1:
        inner = ours.get_base_model() if hasattr(ours, "get_base_model") else ours
        bucket = int(inner.hp_rewrite.plan.runtime.weight_sync_bucket_mb * 2**20)
        itemsize = next(ours.parameters()).element_size()
        rows = [installed.layout(m).expert_shape(m, w).numel() * itemsize for m in holders
                for w in (installed.layout(m).roles if installed.layout(m).modules else installed.layout(m).weight_names)]
        one_each = world * max(rows)  # one expert of each rank: the least a gather can bring
        per_expert = any(".experts.1." in n or ".experts.expert_1." in n for n in want)
        if per_expert and max(sizes) > max(bucket, one_each):
            problems.append(f"{where}: a gather of {max(sizes)} bytes, bucket {bucket}")
        local = installed.binding(holders[0]).placement.num_local
        if per_expert and bucket < local * one_each and len(sizes) <= len(holders) * 2:
            problems.append(f"{where}: {len(sizes)} gathers for {len(holders)} layers: not streamed in buckets")
    last = world - 1
    to_last = list(checkpoint_weights(ours, dst=last))
    if rank == last:
        problems += compare(to_last, want, f"{where} dst={last}", merged)
    elif to_last:
        problems.append(f"{where}: rank {rank} received {len(to_last)} tensors for dst={last}")
    return problems


def _peft_case(directory: str, plan, art: Path, out: Path, rank: int, world: int) -> list[str]:
    """LoRA on attention and on the experts (random B, so the merge changes the weights): the stream
    equals plain PEFT's merge_and_unload saved; the model's tensors and outputs unchanged afterwards."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    adapter = out / "adapter"
    torch.manual_seed(1)
    plain = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory), config)
    if rank == 0:
        plain.save_pretrained(adapter)
    dist.barrier()
    want = plain_files(plain.merge_and_unload(), out / "merged")
    with auto_patch(plan, artifact_dir=art):
        base = transformers.AutoModelForCausalLM.from_pretrained(directory)
    ours = PeftModel.from_pretrained(base, adapter)
    before = {n: t.detach().clone() for n, t in ours.named_parameters()}
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        logits = ours(input_ids=ids).logits
    # the experts' merged weights: the delta of this rank's expert adapters (attention's: the same product)
    problems = stream_problems(ours, want, f"peft ep{plan.ep_size}", rank, world, merged=(".experts.",))
    changed = [n for n, t in ours.named_parameters() if not torch.equal(t.detach(), before[n])]
    with torch.no_grad():
        again = ours(input_ids=ids).logits
    if changed or not torch.equal(logits, again):
        problems.append(f"peft: the model changed while streaming ({changed[:3]})")
    return problems


def weights_payload(checkpoints: dict, out_dir: Path, plans: list[dict]) -> dict:
    """The payload of :func:`checkpoint_weights_world` for the checkpoints of
    :func:`tests.missing_experts_cases.write_checkpoints` (``checkpoints``: its result's root)."""
    from .missing_experts_cases import FAMILIES

    root = Path(checkpoints)
    loads = [{"cls": cls, "dir": str(root / family), "kwargs": {}} for family, (cls, _) in FAMILIES.items()]
    loads.append({"cls": "AutoModelForCausalLM", "dir": str(root / "remote"), "kwargs": {"trust_remote_code": True}})
    plans = [{**p, "peft": str(root / "qwen3_moe")} if p.pop("peft", False) else p for p in map(dict, plans)]
    return {"loads": loads, "out_dir": str(out_dir), "plans": plans}


def checkpoint_weights_world(rank: int, world: int, payload: dict) -> dict:
    """Each checkpoint of ``payload["loads"]`` (class, directory, kwargs) loaded plain and expert-parallel
    under each plan of ``payload["plans"]`` (``{"ep": n, "tp": t, "only": [directory names], "peft":
    a Qwen3-MoE checkpoint for the LoRA case}``); the problems found and the loads checked."""
    torch.set_num_threads(1)
    out = Path(payload["out_dir"])
    art, problems, checked = out / "art", [], []
    for p in payload["plans"]:
        plan = parse_plan(f"version: 1\nep_size: {p['ep']}\ntp_size: {p.get('tp', 1)}\n"
                          f"runtime: {{weight_sync_bucket_mb: {BUCKET_MB}}}\n")
        for i, load in enumerate(payload["loads"]):
            if p.get("only") and Path(load["dir"]).name not in p["only"]:
                continue
            cls = getattr(transformers, load["cls"])
            where = f"{load['cls']} {Path(load['dir']).name} ep{p['ep']} tp{p.get('tp', 1)}"
            torch.manual_seed(0)  # what the checkpoint lacks (a head) drawn the same (#44)
            plain = cls.from_pretrained(load["dir"], **load["kwargs"])
            want = plain_files(plain, out / f"plain-{i}")
            torch.manual_seed(0)
            with auto_patch(plan, artifact_dir=art):
                ours = cls.from_pretrained(load["dir"], **load["kwargs"])
            problems += stream_problems(ours, want, where, rank, world, family=Path(load["dir"]).name)
            checked.append(where)
        if p.get("peft"):
            problems += _peft_case(p["peft"], plan, art, out / f"peft-{p['ep']}-{p.get('tp', 1)}", rank, world)
            checked.append(f"peft ep{p['ep']}")
    return {"problems": problems, "checked": checked}
