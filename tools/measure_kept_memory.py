"""Memory of LoRA training on experts kept quantised (``dequantize=False``) against the same step on
the dequantised model (``dequantize=True``), per rank, at several EP sizes.

A random checkpoint in the Hub's layout (``--quantize mxfp4``: a gpt-oss whose experts are MXFP4
blocks and scales; ``--quantize fp8``: a Qwen3-MoE as the Qwen3-FP8 releases ship it, every Linear in
128x128-block FP8) is loaded by ``hp_rewrite.from_pretrained`` at EP = ``--ep`` on as many gloo
ranks, bf16, once kept and once dequantised, each in its own processes. Each rank puts LoRA (rank
``--lora-rank``) on q/v and on the fused experts (``target_parameters``) and runs one training step
(forward, backward, AdamW on the adapters), with ``runtime.dequant_chunk_mb: --chunk-mb`` (default 8:
about one expert's fp32 values here, as 64 is for one expert of gpt-oss-120b or DeepSeek-V3). It reports:

* resident expert bytes (codes and scales as held, biases) over the stored bytes of its share of the
  checkpoint's expert tensors (target: <= 1.05 kept);
* the bytes of every parameter it holds;
* the bytes autograd saved for the backward (each storage once, parameters left out): the dequantised
  model's LoRA keeps each layer's merged expert weights for its GEMMs' backward, the kept path none;
* the step's peak: the parameters and AdamW state it holds plus the most bytes of tensors made during
  the step alive at once (:class:`PeakLive`), what a GPU's ``max_memory_allocated`` would show;
* the step's peak RSS (kernel high-water mark, reset before the step), for the record only: glibc
  keeps the heap pages of freed temporaries, and the kept run's decoded chunks fragment it, so its RSS
  grows over the first steps by far more than it ever holds at once (malloc_trim gives it back).

    python tools/measure_kept_memory.py --quantize mxfp4 --ep 1 2 4 --json kept_mxfp4.json
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_load_memory import (  # noqa: E402 (the sibling tool's checkpoints)
    _reset_peak,
    _status_kib,
    checkpoint_sizes,
    gpt_oss_config,
    qwen3_moe_config,
    write_checkpoint,
)

MiB = 2**20


def _saved_bytes(params, run) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs, parameters' storages left out."""
    held = set()
    for p in params:
        try:
            held.add(p.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # kept weights: no storage of their own
            pass
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


class PeakLive(TorchDispatchMode):
    """The most bytes of tensors made inside the block alive at once: every op's outputs that do not
    share storage with its inputs are followed, by storage, until the last tensor on it is freed. What
    the CPU can say about a GPU's ``max_memory_allocated`` over a step (glibc's heap keeps freed pages,
    so RSS cannot)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors on it]
        self.total = self.peak = 0

    def _drop(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.total -= entry[0]
                del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        plain = [t for t in tree_leaves((args, kwargs)) if type(t) in (torch.Tensor, torch.nn.Parameter)]
        inputs = {t.untyped_storage().data_ptr() for t in plain}
        for t in tree_leaves(out):
            if type(t) is not torch.Tensor:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in inputs:
                continue
            if ptr in self.live:
                self.live[ptr][1] += 1
            else:
                self.live[ptr] = [storage.nbytes(), 1]
                self.total += storage.nbytes()
            weakref.finalize(t, self._drop, ptr)
        self.peak = max(self.peak, self.total)
        return out


def rank_main(rank: int, world: int, payload: dict) -> dict:
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import FineGrainedFP8Config, Mxfp4Config

    import hp_rewrite
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.runtime.compute.quantized import QuantizedWeight

    torch.set_num_threads(1)
    args = argparse.Namespace(**payload)
    config = (Mxfp4Config if args.quantize == "mxfp4" else FineGrainedFP8Config)(dequantize=args.mode == "dequantized")
    plan = parse_plan(f"version: 1\nep_size: {world}\nruntime:\n  dequant_chunk_mb: {args.chunk_mb}\n")
    model = hp_rewrite.from_pretrained(args.model_dir, plan=plan, artifact_dir=Path(args.artifacts),
                                       quantization_config=config)
    after_load = _status_kib("VmRSS") * 1024
    expert_bytes = model.hp_rewrite.load_report["expert_bytes"]
    param_bytes = sum(p.stored_bytes if isinstance(p, QuantizedWeight) else p.numel() * p.element_size()
                      for p in model.parameters())
    model.train()
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft = get_peft_model(model, lora)
    ddp = DDP(peft)
    optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    params = list(peft.parameters())

    def step() -> None:
        ddp(input_ids=ids, labels=ids).loss.backward()

    step()  # warm: the adapters' optimizer state and every lazy buffer exist before the measured step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    after_warm = _status_kib("VmRSS") * 1024
    _reset_peak()
    before = _status_kib("VmRSS")
    with PeakLive() as live:
        saved = _saved_bytes(params, step)
        optimizer.step()
    high = _status_kib("VmHWM") * 1024
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    optimizer.zero_grad(set_to_none=True)
    return {"expert_bytes": expert_bytes, "param_bytes": param_bytes, "saved_bytes": saved,
            "step_peak_rss": high - before * 1024, "step_peak_abs": high, "rss_after_load": after_load,
            "rss_after_warm_up": after_warm, "optimizer_bytes": state, "step_temporaries": live.peak,
            "step_peak": param_bytes + state + live.peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", choices=("mxfp4", "fp8"), required=True)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--moe-intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--chunk-mb", type=float, default=8.0, help="the plan's runtime.dequant_chunk_mb (both runs)")
    p.add_argument("--out", type=Path, default=Path("bench-results/kept"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from hp_rewrite.launch import run_world

    build = gpt_oss_config if args.quantize == "mxfp4" else qwen3_moe_config
    config = build(args.hidden, args.layers, args.experts, args.moe_intermediate, args.vocab)
    model_dir = args.out / f"{config.model_type}-{args.quantize}-h{args.hidden}-l{args.layers}-e{args.experts}"
    if not (model_dir / "config.json").is_file():
        write_checkpoint(config, model_dir, quantize=args.quantize)
    experts_on_disk, other_on_disk = checkpoint_sizes(model_dir)
    rows = []
    for ep in args.ep:
        figures = {}
        for mode in ("kept", "dequantized"):
            payload = {"model_dir": str(model_dir), "artifacts": str(args.out / "artifacts"), "mode": mode,
                       "quantize": args.quantize, "vocab": args.vocab, "batch": args.batch, "seq": args.seq,
                       "lora_rank": args.lora_rank, "chunk_mb": args.chunk_mb}
            figures[mode] = run_world(ep, f"{Path(__file__).stem}:rank_main", payload, timeout=3600)
        share = experts_on_disk / ep
        for rank in range(ep):
            kept, deq = figures["kept"][rank], figures["dequantized"][rank]
            rows.append({"ep": ep, "rank": rank, "stored_share": share, "kept": kept, "dequantized": deq,
                         "resident_over_stored": kept["expert_bytes"] / share,
                         "peak_ratio": kept["step_peak"] / deq["step_peak"]})
    print(f"{args.quantize}: experts {experts_on_disk / MiB:.1f} MiB on disk, the rest {other_on_disk / MiB:.1f} MiB")
    print("| EP | rank | expert share on disk MiB | experts held kept / dequantised MiB | kept / share | "
          "saved for backward kept / dequantised MiB | step peak kept / dequantised MiB | kept / dequantised | "
          "peak RSS kept / dequantised MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        k, d = r["kept"], r["dequantized"]
        print(f"| {r['ep']} | {r['rank']} | {r['stored_share'] / MiB:.1f} | {k['expert_bytes'] / MiB:.1f} / "
              f"{d['expert_bytes'] / MiB:.1f} | **{r['resident_over_stored']:.3f}** | {k['saved_bytes'] / MiB:.1f} / "
              f"{d['saved_bytes'] / MiB:.1f} | {k['step_peak'] / MiB:.1f} / {d['step_peak'] / MiB:.1f} | "
              f"**{r['peak_ratio']:.2f}** | {k['step_peak_abs'] / MiB:.0f} / {d['step_peak_abs'] / MiB:.0f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"quantize": args.quantize, "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
