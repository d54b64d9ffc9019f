"""hp_rewrite.fully_shard at full scale without the hardware: DeepSeek-V3 (61 layers, 256 routed
experts) built on the meta device, rewritten and sharded as rank R of a world of W by torch's fake
process group (collectives that do nothing), once per rank. For every rank it checks that each
parameter's local shard has the shape FSDP2's rule gives (dim-0 chunks of the global tensor: the
whole model for dense weights over the world, this EP rank's experts over the expert replicas), and
it sums the bytes each rank holds.

    python tools/fsdp_dry_run.py --world 256 --ep 64 --json dry_run.json          # every rank
    python tools/fsdp_dry_run.py --world 256 --ep 64 --ranks 0 1 255             # a few

Bytes are bf16 parameters; multiply by 8 (bf16 weights + fp32 gradient... see docs) for training
state. Prints one line per layout: ranks checked, min / max bytes per rank, and the ideal (all
parameters / world).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def deepseek_v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config()  # the defaults are DeepSeek-V3's: 61 layers, 256 routed experts, hidden 7168


def expected_local_shape(global_shape: tuple[int, ...], dim: int, size: int, index: int) -> tuple[int, ...]:
    """FSDP2's shard of ``global_shape`` on ``dim`` for rank ``index`` of ``size``: torch.chunk's rule."""
    n = global_shape[dim]
    chunk = math.ceil(n / size)
    local = max(0, min(chunk, n - chunk * index))
    return (*global_shape[:dim], local, *global_shape[dim + 1 :])


def shard_rank(rank: int, world: int, ep: int, artifact_dir: Path) -> dict:
    """Rewrite and fully_shard the meta model as ``rank`` of a fake world; check and count its shards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hp_rewrite
    from hp_rewrite.hf import meta_model
    from hp_rewrite.loading.patch import rewrite_model
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.sync.gradients import expert_parameters

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        config = deepseek_v3_config()
        model = meta_model(config).to(torch.bfloat16)
        global_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        plan = parse_plan(f"version: 1\nep_size: {ep}\n")
        model = rewrite_model(model, plan, artifact_dir=artifact_dir)
        experts = {id(p) for p in expert_parameters(model)}
        local_rows = {n: tuple(p.shape) for n, p in model.named_parameters() if id(p) in experts}
        hp_rewrite.fully_shard(model)
        info = model.hp_rewrite
        replicas, replica_rank = info.ep.replica_size, info.ep.replica_rank
        bad, total = [], 0
        for name, p in model.named_parameters():
            local = p.to_local()
            placement = p.placements[-1]
            if name in local_rows:  # this EP rank's experts, sharded over the expert replicas
                want = expected_local_shape(local_rows[name], placement.dim, replicas, replica_rank)
            else:
                want = expected_local_shape(global_shapes[name], placement.dim, world, rank)
            if tuple(local.shape) != want:
                bad.append(f"{name}: {tuple(local.shape)} != {want}")
            total += local.numel() * local.element_size()
        return {"rank": rank, "bytes": total, "bad": bad[:5], "params": sum(math.prod(s) for s in global_shapes.values())}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=256)
    parser.add_argument("--ep", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--ranks", type=int, nargs="*", help="ranks to check (default: every rank)")
    parser.add_argument("--artifacts", default="/tmp/hp-rewrite-dry-run")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {}
    for ep in args.ep:
        ranks = args.ranks if args.ranks else range(args.world)
        rows = [shard_rank(r, args.world, ep, Path(args.artifacts)) for r in ranks]
        sizes = [r["bytes"] for r in rows]
        ideal = rows[0]["params"] * 2 / args.world  # bf16
        bad = [b for r in rows for b in r["bad"]]
        results[f"ep{ep}xefsdp{args.world // ep}"] = {
            "ranks_checked": len(rows), "min_bytes": min(sizes), "max_bytes": max(sizes), "ideal_bytes": ideal,
            "params": rows[0]["params"], "bad_shapes": bad[:10],
        }
        print(f"EP {ep} x efsdp {args.world // ep}: {len(rows)} ranks checked, "
              f"{'all shard shapes as FSDP2 cuts them' if not bad else f'{len(bad)} wrong shapes: {bad[:3]}'}; "
              f"bf16 parameters per rank {min(sizes) / 2**30:.2f}-{max(sizes) / 2**30:.2f} GiB "
              f"(ideal {ideal / 2**30:.2f} GiB, {rows[0]['params'] / 1e9:.1f} B parameters)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if any(r["bad_shapes"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
