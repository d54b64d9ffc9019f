"""Peak resident memory of only-local-experts loading (``load_expert_parallel``) on N gloo ranks.

1. Writes a random-weight Qwen3-MoE checkpoint (fp32, default hidden 1024, 4 layers, 64 experts,
   expert width 1024: 3.3 GB) in the layout ``save_pretrained`` writes (per-expert
   ``mlp.experts.{i}.{gate,up,down}_proj.weight``), one layer at a time: the model is built on the
   meta device, each layer's tensors are drawn at random in their in-memory names and turned into
   the on-disk names by transformers' ``revert_weight_conversion``, then saved as one shard, with
   ``model.safetensors.index.json``. The generator never holds more than one layer.
2. Spawns ``--nproc`` gloo ranks (``hp_rewrite.launch.run_world``). Each loads a tiny Qwen3-MoE
   checkpoint first (warm-up: imports and one-time initialisation belong to the process), resets
   its kernel resident-set high-water mark (``echo 5 > /proc/self/clear_refs``), reads its RSS
   (``VmRSS``: the baseline), calls ``load_expert_parallel`` at EP=``--ep`` and reads the high-water
   mark (``VmHWM``). The mark is also read and reset between the two phases of the call: the
   analysis (it runs one block of each class with random weights to confirm the archetype) and the
   weights (install on meta, then every tensor read into its local storage).
3. Prints and writes (``--json``) per rank: peak - baseline for the whole call and for each phase,
   against the bound ``1.15 * (non-expert bytes + all expert bytes / ep)``.

``--quantize fp8`` writes the Qwen3-MoE checkpoint as the Qwen3-FP8 releases ship (bf16, every Linear
weight float8_e4m3fn with a ``weight_scale_inv`` per 128x128 block, experts per expert);
``--quantize mxfp4`` a gpt-oss one as gpt-oss ships (MXFP4 expert blocks and scales). Codes are
random (any byte is valid). The bound is then on the rank's final, dequantised (bf16) bytes.

    python tools/measure_load_memory.py --out /tmp/hp-load-mem --json bench-results/load_memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

SLACK = 1.15


# ----------------------------------------------------------------------------------------------
# checkpoint


def qwen3_moe_config(hidden: int, layers: int, experts: int, moe_intermediate: int, vocab: int):
    from transformers import Qwen3MoeConfig

    heads = max(1, hidden // 128)
    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=moe_intermediate,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=128,
        num_experts=experts,
        num_experts_per_tok=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def gpt_oss_config(hidden: int, layers: int, experts: int, moe_intermediate: int, vocab: int):
    from transformers import GptOssConfig

    heads = max(1, hidden // 64)
    return GptOssConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=moe_intermediate,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                        head_dim=64, num_local_experts=experts, num_experts_per_tok=4, max_position_embeddings=4096,
                        tie_word_embeddings=False)


FP8_BLOCK = (128, 128)  # the Hub's weight_block_size


def quantize_state(model, state: dict, method: str, gen) -> dict:
    """The tensors of one shard in the Hub's quantised layout, with random codes (any byte is valid):
    fp8, every 2-D Linear / per-expert weight as float8_e4m3fn + a weight_scale_inv per 128x128 block;
    mxfp4, the fused expert tensors as ``*_blocks`` / ``*_scales`` (scales near 2^-7)."""
    import math

    import torch

    from hp_rewrite.loading.quantized import fp8_linear_weights

    linears = fp8_linear_weights(model)
    out = {}
    for key, value in state.items():
        if method == "fp8" and value.dim() == 2 and (key in linears or ".experts." in key):
            out[key] = value.to(torch.float8_e4m3fn)  # N(0, 1): well inside e4m3's range
            grid = [math.ceil(n / b) for n, b in zip(value.shape, FP8_BLOCK, strict=True)]
            out[f"{key}_scale_inv"] = torch.rand(grid, generator=gen).mul_(0.02).add_(0.01)
        elif method == "mxfp4" and value.dim() == 3 and key.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj"):
            e, n_in, n_out = value.shape  # in-first: the blocks are out-first
            out[f"{key}_blocks"] = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8, generator=gen)
            out[f"{key}_scales"] = torch.randint(118, 124, (e, n_out, n_in // 32), dtype=torch.uint8, generator=gen)
        else:
            out[key] = value.to(torch.bfloat16)
    return out


def write_checkpoint(config, out: Path, seed: int = 0, quantize: str | None = None) -> dict:
    """A random fp32 checkpoint of ``config`` (bf16 and ``quantize``d as the Hub ships it, with
    ``quantize``), one shard per decoder layer (+ one for the rest)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    meta = model.state_dict()
    groups: dict[str, list[str]] = {}
    for name in meta:
        parts = name.split(".")
        group = f"layer{int(parts[2]):03d}" if parts[:2] == ["model", "layers"] else "other"
        groups.setdefault(group, []).append(name)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    names = sorted(groups)
    for n, group in enumerate(names):
        state = {}
        for name in groups[group]:
            shape = meta[name].shape
            if name.endswith("norm.weight"):
                state[name] = torch.ones(shape)
            else:
                state[name] = torch.randn(shape, generator=gen).mul_(0.02)
        state = revert_weight_conversion(model, state)  # in-memory names -> the names save_pretrained writes
        if quantize is not None:
            state = quantize_state(model, state, quantize, gen)
        file = f"model-{n + 1:05d}-of-{len(names):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, out / file, metadata={"format": "pt"})
        for k, v in state.items():
            weight_map[k] = file
            total += v.numel() * v.element_size()
        del state
        gc.collect()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    )
    if quantize is not None:
        from hp_rewrite.loading.quantized import hub_quantization_config

        config.dtype = torch.bfloat16
        config.quantization_config = hub_quantization_config(quantize, FP8_BLOCK)
    config.save_pretrained(out)
    return {"bytes": total, "files": len(names)}


def checkpoint_sizes(model_dir: Path) -> tuple[int, int]:
    """(expert bytes, other bytes) of a checkpoint, from its safetensors headers."""
    import math

    from safetensors import safe_open

    experts = other = 0
    size = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "U8": 1}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                n = math.prod(h.get_slice(k).get_shape()) * size[h.get_slice(k).get_dtype()]
                if ".mlp.experts." in k:
                    experts += n
                else:
                    other += n
    return experts, other


# ----------------------------------------------------------------------------------------------
# one rank


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def rank_main(rank: int, world: int, payload: dict) -> dict:
    import torch

    from hp_rewrite.loading import install as install_step
    from hp_rewrite.loading.local import load_expert_parallel
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.runtime.group.groups import build_expert_parallel_group

    torch.set_num_threads(1)
    ep = build_expert_parallel_group(payload["ep"])
    plan = parse_plan(f"version: 1\nep_size: {payload['ep']}\n")
    warm, _ = load_expert_parallel(payload["warmup_dir"], plan, ep, payload["artifact_dir"])
    del warm
    gc.collect()

    phases: dict[str, int] = {}
    install = install_step.install

    def timed_install(*args, **kwargs):  # called right after the analysis: close its phase
        phases["analysis_peak"] = _status_kib("VmHWM") * 1024
        _reset_peak()
        return install(*args, **kwargs)

    install_step.install = timed_install
    try:
        _reset_peak()
        baseline = _status_kib("VmRSS") * 1024
        t0 = time.perf_counter()
        model, report = load_expert_parallel(payload["model_dir"], plan, ep, payload["artifact_dir"])
        wall = time.perf_counter() - t0
        phases["weights_peak"] = _status_kib("VmHWM") * 1024
    finally:
        install_step.install = install
    end_rss = _status_kib("VmRSS") * 1024
    return {
        "baseline": baseline,
        "analysis_peak": phases["analysis_peak"],
        "weights_peak": phases["weights_peak"],
        "end_rss": end_rss,
        "wall_s": wall,
        "report": report,
    }


def sharded_rank(rank: int, world: int, payload: dict) -> dict:
    """``hp_rewrite.load_fully_sharded``: FSDP2 shards read straight from the files; the bound is this
    rank's final bytes (its shards and buffers)."""
    import torch
    from torch.distributed.tensor import DTensor

    import hp_rewrite
    from hp_rewrite.loading import local
    from hp_rewrite.loading.patch import expert_parallel_group_for
    from hp_rewrite.plan import parse_plan

    torch.set_num_threads(1)
    plan = parse_plan(f"version: 1\nep_size: {payload['ep']}\n")
    warm = hp_rewrite.load_fully_sharded(payload["warmup_dir"], plan, artifact_dir=payload["artifact_dir"])
    del warm
    local.prepare(payload["model_dir"], plan, expert_parallel_group_for(plan), payload["artifact_dir"])  # artifact
    local._release_freed_memory()
    _reset_peak()
    baseline = _status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    model = hp_rewrite.load_fully_sharded(payload["model_dir"], plan, artifact_dir=payload["artifact_dir"])
    wall = time.perf_counter() - t0
    peak = _status_kib("VmHWM") * 1024
    final = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
                for t in list(model.parameters()) + list(model.buffers()))
    return {"baseline": baseline, "peak": peak, "final_bytes": final, "wall_s": wall,
            "bytes_read": model.hp_rewrite.load_report["bytes_read"]}


def full_rank(rank: int, world: int, payload: dict) -> dict:
    """For contrast: today's path, ``from_pretrained`` of the whole checkpoint, then shard in memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from hp_rewrite import rewrite
    from hp_rewrite.loading.local import load_expert_parallel
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.runtime.group.groups import ExpertParallelGroup

    torch.set_num_threads(1)
    plan = parse_plan(f"version: 1\nep_size: {payload['ep']}\n")
    ep = ExpertParallelGroup(size=payload["ep"], rank=0)  # keep_local_experts needs no communication
    warm, _ = load_expert_parallel(payload["warmup_dir"], plan, ep, payload["artifact_dir"])
    del warm
    gc.collect()
    _reset_peak()
    baseline = _status_kib("VmRSS") * 1024
    model = AutoModelForCausalLM.from_pretrained(
        payload["model_dir"], dtype=torch.float32, attn_implementation="eager"
    )
    loaded_peak = _status_kib("VmHWM") * 1024
    analysis = rewrite.analyze(model, plan)
    artifact = rewrite.write(analysis, plan, model.config, Path(payload["artifact_dir"]))
    rewrite.install(model, artifact, plan, ep, shard=True)
    gc.collect()
    return {"baseline": baseline, "loaded_peak": loaded_peak, "peak": _status_kib("VmHWM") * 1024,
            "end_rss": _status_kib("VmRSS") * 1024}  # fmt: skip


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, default=Path("/tmp/hp-load-mem"), help="where the checkpoint is written"
    )
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--moe-intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--quantize", choices=("mxfp4", "fp8"), default=None,
                   help="write the checkpoint in bf16 and this Hub layout (fp8: Qwen3-MoE with block-FP8 Linear "
                   "weights; mxfp4: gpt-oss with MXFP4 experts): each rank dequantises its share at load")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: --ep)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (reused when its config matches)")
    p.add_argument(
        "--compare-full",
        action="store_true",
        help="also measure from_pretrained of the whole checkpoint + in-memory sharding (one process)",
    )
    p.add_argument(
        "--fully-shard",
        action="store_true",
        help="measure hp_rewrite.load_fully_sharded (FSDP2 shards read straight from the files) instead",
    )
    args = p.parse_args(argv)

    import shutil

    from hp_rewrite.launch import run_world
    from hp_rewrite.tiny import make_tiny

    build = gpt_oss_config if args.quantize == "mxfp4" else qwen3_moe_config
    config = build(args.hidden, args.layers, args.experts, args.moe_intermediate, args.vocab)
    tag = f"h{args.hidden}-l{args.layers}-e{args.experts}-i{args.moe_intermediate}-v{args.vocab}"
    model_dir = args.out / (f"{config.model_type}-{tag}" + (f"-{args.quantize}" if args.quantize else ""))
    t0 = time.perf_counter()
    if not (model_dir / "model.safetensors.index.json").is_file():
        shutil.rmtree(model_dir, ignore_errors=True)
        written = write_checkpoint(config, model_dir, quantize=args.quantize)
        print(
            f"wrote {model_dir}: {written['bytes'] / 1e9:.2f} GB in {written['files']} files "
            f"({time.perf_counter() - t0:.0f} s)"
        )
    warmup_dir = args.out / "warmup-qwen3_moe"
    if not warmup_dir.exists():
        make_tiny("qwen3_moe", warmup_dir)
    expert_bytes, other_bytes = checkpoint_sizes(model_dir)
    payload = {
        "model_dir": str(model_dir),
        "warmup_dir": str(warmup_dir),
        "ep": args.ep,
        "artifact_dir": str(args.out / "artifacts"),
    }
    if args.fully_shard:
        ranks = run_world(args.nproc or args.ep, f"{Path(__file__).stem}:sharded_rank", payload, timeout=1800)
        for rank, r in enumerate(ranks):
            used = r["peak"] - r["baseline"]
            print(f"rank {rank}: load peak - baseline {used / 2**20:.1f} MiB, final shards {r['final_bytes'] / 2**20:.1f} "
                  f"MiB, ratio {used / r['final_bytes']:.3f} (bound {SLACK}); read {r['bytes_read'] / 2**20:.1f} MiB "
                  f"of {(expert_bytes + other_bytes) / 2**20:.1f} MiB; {r['wall_s']:.1f} s")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"mode": "fully_shard", "ranks": ranks}, indent=2))
        return 0 if all(r["peak"] - r["baseline"] <= SLACK * r["final_bytes"] for r in ranks) else 1
    ranks = run_world(args.nproc or args.ep, f"{Path(__file__).stem}:rank_main", payload, timeout=1800)

    mib = 2**20
    rows = []
    print(
        f"\ncheckpoint {(expert_bytes + other_bytes) / 1e9:.2f} GB (experts {expert_bytes / 1e9:.2f} GB), "
        f"EP={args.ep} on {len(ranks)} gloo ranks"
    )
    print(
        "| rank | baseline MiB | share MiB | bound MiB | call peak MiB | analysis peak MiB | weights peak MiB | "
        "call / share | weights / share | read MiB | load s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rank, r in enumerate(ranks):
        rep = r["report"]
        share = rep["non_expert_bytes"] + rep["expert_bytes"]
        analysis = r["analysis_peak"] - r["baseline"]
        weights = r["weights_peak"] - r["baseline"]
        call = max(analysis, weights)
        row = {
            "rank": rank,
            "baseline": r["baseline"],
            "share": share,
            "bound": SLACK * share,
            "call_peak": call,
            "analysis_peak": analysis,
            "weights_peak": weights,
            "bytes_read": rep["bytes_read"],
            "load_s": rep["seconds"],
            "timings": rep["timings"],
            "files_read": len(rep["files_read"]),
            "expert_bytes": rep["expert_bytes"],
            "non_expert_bytes": rep["non_expert_bytes"],
        }
        rows.append(row)
        print(
            f"| {rank} | {r['baseline'] / mib:.0f} | {share / mib:.1f} | {SLACK * share / mib:.1f} | "
            f"{call / mib:.1f} | {analysis / mib:.1f} | {weights / mib:.1f} | {call / share:.3f} | "
            f"{weights / share:.3f} | {rep['bytes_read'] / mib:.1f} | {rep['seconds']:.1f} |"
        )
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {"hidden": args.hidden, "layers": args.layers, "experts": args.experts,
                   "moe_intermediate": args.moe_intermediate, "vocab": args.vocab},
        "checkpoint_bytes": expert_bytes + other_bytes, "expert_bytes": expert_bytes, "other_bytes": other_bytes,
        "ep": args.ep, "ranks": rows, "slack": SLACK, "quantize": args.quantize,
        "weights_within_bound": all(r["weights_peak"] <= r["bound"] for r in rows),
        "call_within_bound": all(r["call_peak"] <= r["bound"] for r in rows),
    }  # fmt: skip
    print(
        f"\nweights phase within {SLACK}x share: {result['weights_within_bound']}; "
        f"whole call (analysis included): {result['call_within_bound']}"
    )
    if args.compare_full:
        (full,) = run_world(1, f"{Path(__file__).stem}:full_rank", payload, timeout=1800)
        result["full_load"] = {k: full[k] - full["baseline"] for k in ("loaded_peak", "peak", "end_rss")}
        print(
            f"from_pretrained + keep_local_experts (one process): peak {result['full_load']['peak'] / mib:.0f} MiB "
            f"over baseline (after from_pretrained {result['full_load']['loaded_peak'] / mib:.0f} MiB, "
            f"resident at the end {result['full_load']['end_rss'] / mib:.0f} MiB)"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if not args.keep:
        shutil.rmtree(model_dir, ignore_errors=True)
    return 0 if result["weights_within_bound"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks import this file by name
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
