"""Bytes on the wire per lent expert under ``runtime.balance: auto``, by how the experts are held.

Why: a lent expert's weights cross the wire once in the forward and its gradient comes back once in
the backward (hp_rewrite/runtime/balance/replicas.py, ``_Parts``), so what travels sets whether lending
pays. Dense experts travel as weights and return dense gradients; with PEFT's LoRA on the experts
(``target_parameters``, factored form) the frozen weight as stored travels with the factors and only the
factors' gradients come back; experts kept quantised (``dequantize=False``) travel as their codes and
scales as stored, plus the factors.

How: a random checkpoint in the Hub's layout at one realistic expert size (default H 2048 x I 768, as
Qwen3-30B-A3B or a DeepSeek-V3-like layer; 8 experts, 2 layers, a small vocabulary): a DeepSeek-V3 in
128x128-block FP8 and a gpt-oss in MXFP4 (the sibling tool ``measure_load_memory``'s writer, random
codes). One 2-rank gloo world at EP 2 (plan: ``balance: auto``, threshold 1.0, min rows 1: any
imbalance lends) loads each case with ``hp_rewrite.from_pretrained`` in bf16, runs one training forward
+ backward on a different batch per rank and sums, over layers and ranks, each experts holder's
``installed.last_stats``: ``lent_bytes / lent`` and ``lent_grad_bytes / lent`` are the bytes per lent
expert, checked against a hand count (bf16 2 bytes a value; FP8 1 byte + an fp32 scale per 128x128
block; MXFP4 half a byte + a 1-byte scale per 32 values; LoRA r x (in + out) per matrix, in bf16: PEFT
casts the factors to the weight's dtype; gpt-oss's bf16 biases travel too, frozen under LoRA).

    python tools/measure_lent_bytes.py                       # 1-2 minutes on 2 CPU cores (+ the checkpoints once)
    python tools/measure_lent_bytes.py --hidden 1024 --moe-intermediate 512 --lora-rank 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_load_memory import gpt_oss_config, write_checkpoint  # noqa: E402 (the sibling tool's checkpoints)

PLAN = "version: 1\nep_size: 2\nruntime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1}\n"
#: (label, model type, checkpoint format, dequantised?, LoRA?); each format's first row is its baseline
CASES = (
    ("DeepSeek-V3 dequantised bf16", "deepseek_v3", "fp8", True, False),
    ("DeepSeek-V3 dequantised bf16 + LoRA", "deepseek_v3", "fp8", True, True),
    ("DeepSeek-V3 block-FP8 kept + LoRA", "deepseek_v3", "fp8", False, True),
    ("gpt-oss dequantised bf16", "gpt_oss", "mxfp4", True, False),
    ("gpt-oss dequantised bf16 + LoRA", "gpt_oss", "mxfp4", True, True),
    ("gpt-oss MXFP4 kept + LoRA", "gpt_oss", "mxfp4", False, True),
)


def deepseek_v3_config(hidden: int, layers: int, experts: int, moe_intermediate: int, vocab: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=moe_intermediate,
                            moe_intermediate_size=moe_intermediate, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=4, n_shared_experts=1, n_routed_experts=experts, n_group=1,
                            topk_group=1, num_experts_per_tok=2, first_k_dense_replace=0, q_lora_rank=512,
                            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                            max_position_embeddings=4096, tie_word_embeddings=False)


def expected(model_type: str, fmt: str, dequantized: bool, lora: bool, h: int, i: int, r: int) -> dict:
    """One expert by hand: parameters, forward bytes, backward bytes (gate+up fused [2I, H], down [H, I])."""
    values = 3 * h * i
    biases = 2 * i + h if model_type == "gpt_oss" else 0
    if dequantized:
        weights = 2 * values
    elif fmt == "fp8":
        weights = values + 4 * values // (128 * 128)
    else:
        weights = values // 2 + values // 32
    factors = 2 * r * ((h + 2 * i) + (i + h)) if lora else 0
    return {"params": values + biases, "fwd": weights + 2 * biases + factors,
            "bwd": factors if lora else weights + 2 * biases}


def rank_main(rank: int, world: int, payload: dict) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import FineGrainedFP8Config, Mxfp4Config
    from transformers.utils.logging import disable_progress_bar

    import hp_rewrite
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.runtime import installed

    torch.set_num_threads(1)
    disable_progress_bar()
    args = argparse.Namespace(**payload)
    out = {}
    for label, _, fmt, dequantized, lora in CASES:
        quant = (Mxfp4Config if fmt == "mxfp4" else FineGrainedFP8Config)(dequantize=dequantized)
        model = hp_rewrite.from_pretrained(args.dirs[fmt], plan=parse_plan(PLAN), artifact_dir=Path(args.artifacts),
                                           dtype=torch.bfloat16, quantization_config=quant)
        model.train()
        if lora:
            model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                     target_parameters=["mlp.experts.gate_up_proj",
                                                                        "mlp.experts.down_proj"]))
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        stats = [installed.last_stats(h) for _, h in installed.holders(model)]
        out[label] = {k: sum(getattr(s, k) for s in stats) for k in ("lent", "guests", "lent_bytes", "lent_grad_bytes")}
        out[label]["layers"] = len(stats)
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048, help="multiple of 128 (FP8 blocks) and 32 (MXFP4)")
    p.add_argument("--moe-intermediate", type=int, default=768, help="multiple of 128 and 32")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("bench-results/lent-bytes"),
                   help="where the checkpoints are written (reused when present)")
    args = p.parse_args(argv)
    if args.hidden % 128 or args.moe_intermediate % 128:
        p.error("--hidden and --moe-intermediate must be multiples of 128 (FP8 blocks; MXFP4 needs 32)")

    from hp_rewrite.launch import run_world

    dirs = {}
    for fmt, build in (("fp8", deepseek_v3_config), ("mxfp4", gpt_oss_config)):
        config = build(args.hidden, args.layers, args.experts, args.moe_intermediate, args.vocab)
        tag = f"h{args.hidden}-i{args.moe_intermediate}-l{args.layers}-e{args.experts}-v{args.vocab}"
        dirs[fmt] = args.out / f"{config.model_type}-{fmt}-{tag}"
        if not (dirs[fmt] / "config.json").is_file():
            write_checkpoint(config, dirs[fmt], quantize=fmt)
    payload = {"dirs": {k: str(v) for k, v in dirs.items()}, "artifacts": str(args.out / "artifacts"),
               "vocab": args.vocab, "batch": args.batch, "seq": args.seq, "lora_rank": args.lora_rank}
    per_rank = run_world(2, f"{Path(__file__).stem}:rank_main", payload, timeout=3600)

    h, i, r = args.hidden, args.moe_intermediate, args.lora_rank
    print(f"Command: python {' '.join(['tools/measure_lent_bytes.py', *sys.argv[1:]])}")
    print(f"Expert: H {h} x I {i} (gate+up [2I, H], down [H, I]), LoRA r={r} on both; EP 2, {args.experts} experts, "
          f"{args.layers} layers, {args.batch}x{args.seq} tokens per rank, bf16\n")
    print("| case | params / expert | lent (layers x ranks) | forward bytes / lent expert | backward bytes / lent "
          "expert | forward / baseline's | by hand: forward, backward |")
    print("|---|---|---|---|---|---|---|")
    base = None
    mismatch = []
    for label, model_type, fmt, dequantized, lora in CASES:
        total = {k: sum(rr[label][k] for rr in per_rank) for k in ("lent", "guests", "lent_bytes", "lent_grad_bytes")}
        want = expected(model_type, fmt, dequantized, lora, h, i, r)
        if dequantized and not lora:  # this model's baseline (None if nothing was lent)
            base = total["lent_bytes"] / total["lent"] if total["lent"] else None
        if not total["lent"]:
            print(f"| {label} | {want['params']:,} | 0 (nothing lent: no figure) | - | - | - | "
                  f"{want['fwd']:,}, {want['bwd']:,} |")
            continue
        fwd, bwd = total["lent_bytes"] / total["lent"], total["lent_grad_bytes"] / total["lent"]
        ok = fwd == want["fwd"] and bwd == want["bwd"]
        if not ok:
            mismatch.append(label)
        print(f"| {label} | {want['params']:,} | {total['lent']} | {fwd:,.0f} ({fwd / 2**20:.2f} MiB) | "
              f"{bwd:,.0f} ({bwd / 2**20:.3f} MiB) | {fwd / base if base else float('nan'):.3f} | {want['fwd']:,}, {want['bwd']:,} "
              f"{'(match)' if ok else '**(differs)**'} |")
    print(f"\nHand count matches every measured case: {'yes' if not mismatch else 'no: ' + ', '.join(mismatch)}")
    return 0 if not mismatch else 1


if __name__ == "__main__":
    raise SystemExit(main())
