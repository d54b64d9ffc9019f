"""Peak memory of handing an expert-parallel model's weights to an inference engine (``checkpoint_weights``).

One Qwen3-30B-A3B-shaped MoE decoder layer (hidden 2048, 128 experts of width 768, top-8, 32 query and
4 KV heads of 128; bf16; a 2048-word vocabulary instead of 151936, the embedding being a dense tensor
like any other) at EP = ``--nproc`` on gloo ranks. Each configuration runs in its own world, in turn:

* ``bucket N``: ``checkpoint_weights`` with the plan's ``runtime.weight_sync_bucket_mb: N`` (512 is
  the default), every rank receiving (``dst=None``, colocated engines);
* ``whole tensor``: the bucket set above a layer's experts, so each fused expert tensor is gathered
  whole (805 MB for ``gate_up_proj`` at this shape): what a sync that gathers full tensors holds.

Per rank, while a consumer takes each tensor and drops it (as vLLM's ``load_weights`` copies it into
its own parameters): the most bytes of tensors the pass made that were alive at once (a dispatch mode
following them by storage: what a GPU's allocator would hold), the resident-set high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` after a warm-up pass) minus the resident set
before the pass (gloo's own staging included), and the pass's wall time.

    python tools/measure_weight_sync.py --nproc 2 --json bench-results/weight_sync.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=6144,
                          moe_intermediate_size=args.moe_intermediate, num_hidden_layers=1, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=args.experts, num_experts_per_tok=8,
                          tie_word_embeddings=False)


def worker(rank: int, world: int, payload: dict) -> dict:
    import torch
    from transformers import Qwen3MoeForCausalLM

    import hp_rewrite
    from hp_rewrite.loading.patch import rewrite_model
    from hp_rewrite.plan import parse_plan

    torch.set_num_threads(2)
    args = argparse.Namespace(**payload["args"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(_config(args))
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    for p in model.parameters():
        with torch.no_grad():
            p.normal_(0, 0.02)
    plan = parse_plan(f"version: 1\nep_size: {world}\nruntime: {{weight_sync_bucket_mb: {payload['bucket_mb']}}}\n")
    model = rewrite_model(model, plan, artifact_dir=Path(payload["out"]) / "art")
    gc.collect()

    def one_pass() -> tuple[int, int, float]:
        count = size = 0
        start = time.perf_counter()
        for _, t in hp_rewrite.checkpoint_weights(model):
            count, size = count + 1, size + t.numel() * t.element_size()
            del t  # as an engine's load_weights: copied into its own parameters, then let go
        return count, size, time.perf_counter() - start

    from tests.host_traffic import LiveTemporaries

    one_pass()  # warm-up: the conversions' probes, gloo's buffers
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status_kib("VmRSS")
    count, size, seconds = one_pass()
    peak = _status_kib("VmHWM") - baseline
    with LiveTemporaries() as live:  # the tensors the pass makes (what a GPU's allocator would hold)
        one_pass()
    return {"tensors": count, "bytes": size, "seconds": seconds, "peak_mib": peak / 1024,
            "allocated_mib": live.peak / 2**20}


def main() -> None:
    from hp_rewrite.launch import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--buckets", default="512,64", help="the plan's weight_sync_bucket_mb values to measure")
    parser.add_argument("--out", default="/tmp/hp-weight-sync")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    row = 2 * args.moe_intermediate * args.hidden * 2  # one expert's gate_up_proj rows, bf16
    whole = 4 * args.experts * row / 2**20  # above a layer's experts: the whole tensor at once
    runs = [(f"bucket {b} MB", float(b)) for b in args.buckets.split(",")] + [("whole tensor", whole)]
    results = {}
    for label, bucket in runs:
        payload = {"args": vars(args), "bucket_mb": bucket, "out": args.out}
        results[label] = run_world(args.nproc, "tools.measure_weight_sync:worker", payload, timeout=1200)
        r = results[label]
        print(f"{label:>14}: tensors made {max(x['allocated_mib'] for x in r):7.1f} MiB at most at once, "
              f"resident set +{max(x['peak_mib'] for x in r):7.1f} MiB (worst rank), "
              f"{r[0]['tensors']} tensors, {r[0]['bytes'] / 2**20:.0f} MiB streamed, "
              f"{max(x['seconds'] for x in r):.2f} s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
