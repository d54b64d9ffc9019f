"""Per-rank training memory of an expert-parallel model, replicated (DDP) against hp_rewrite.fully_shard.

On ``--nproc`` gloo ranks, a Qwen3-MoE config where the non-expert weights dominate (a large
vocabulary and attention, few small experts: the case FSDP2 is for) is rewritten at EP=``--ep``
and trained for two AdamW steps, once wrapped in DDP (every non-expert weight on every rank) and
once sharded by ``hp_rewrite.fully_shard``. Each rank reports the bytes it holds for parameters,
gradients and AdamW state (the local shards of DTensors), and the peak RSS growth of a training
step (kernel high-water mark, reset before the step). The target for fully_shard is
``(non-expert + expert parameters) / world x 16 bytes`` (fp32 weight, gradient and two moments)
within 10%.

    python tools/measure_train_memory.py --nproc 4 --ep 2 --json train_memory.json

``--tp N`` measures activations instead, at a long sequence: the same model (``--vocab`` small, so the
replicated LM head's logits do not hide the rest) run at ``tp_size`` 1, ``tp_size`` N and ``tp_size`` N
with ``sequence_parallel``, one forward and backward each. Each rank reports the bytes autograd saved
for backward (every saved tensor once, parameters left out: the activations the step holds at its
peak), split by the decoder part that saved them (the norms, which sequence parallelism shards; the
attention; the MoE block; the rest: embedding, final norm, LM head, loss), and the peak RSS growth of
the step.

    python tools/measure_train_memory.py --nproc 4 --ep 2 --tp 2 --seq 1024 --vocab 1024 --json tp_memory.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BYTES_PER_PARAM = 16  # fp32 parameter, gradient, AdamW exp_avg and exp_avg_sq


def config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                          num_key_value_heads=8, head_dim=args.hidden // 8, intermediate_size=args.hidden,
                          moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
                          num_experts_per_tok=2, vocab_size=args.vocab, max_position_embeddings=256,
                          tie_word_embeddings=False)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(rank: int, world: int, payload: dict) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import hp_rewrite
    from hp_rewrite.loading.patch import rewrite_model
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.sync.gradients import expert_parameters
    from hp_rewrite.tiny import build_tiny_model

    torch.set_num_threads(1)
    args = argparse.Namespace(**payload)
    base = build_tiny_model(config(args), seed=0).train()
    experts_total = sum(p.numel() for n, p in base.named_parameters() if ".experts." in n)
    dense_total = sum(p.numel() for p in base.parameters()) - experts_total
    plan = parse_plan(f"version: 1\nep_size: {args.ep}\n")
    out = {"dense_params": dense_total, "expert_params": experts_total}
    for mode in ("replicated", "fully_shard"):
        model = rewrite_model(copy.deepcopy(base), plan, artifact_dir=Path(args.artifacts))
        if mode == "fully_shard":
            hp_rewrite.fully_shard(model)
            step_model = model
        else:
            step_model = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(rank)
        peaks = []
        for _ in range(2):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            Path("/proc/self/clear_refs").write_text("5")
            before = _rss_kb("VmRSS")
            step_model(input_ids=ids, labels=ids).loss.backward()
            clip = hp_rewrite.clip_grad_norm_ if mode == "fully_shard" else torch.nn.utils.clip_grad_norm_
            clip(model.parameters(), 1.0)
            optimizer.step()
            peaks.append((_rss_kb("VmHWM") - before) * 1024)
            optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated: they count
        params = _local_bytes(p.detach() for p in model.parameters())
        grads = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        state = _local_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        experts_here = _local_bytes(p.detach() for p in expert_parameters(model))
        out[mode] = {"params": params, "grads": grads, "adamw": state, "total": params + grads + state,
                     "expert_params": experts_here, "step_peak_rss": peaks[-1]}
        del step_model, model, optimizer
        dist.barrier()
    out["target_fully_shard"] = (dense_total + experts_total) / world * BYTES_PER_PARAM
    out["target_replicated"] = (dense_total + experts_total / args.ep) * BYTES_PER_PARAM
    return out


PARTS = ("norms", "attention", "moe", "rest")  # where the decoder's saved activations come from


def _part(path: str) -> str | None:
    name = path.rpartition(".")[2]
    if name.endswith("layernorm"):
        return "norms"  # the decoder norms: sequence-parallel
    if name == "self_attn":
        return "attention"
    if name == "mlp":
        return "moe"
    return None


def _saved_bytes(model, step) -> dict[str, int]:
    """Bytes of the tensors autograd saves during ``step()``, per part of the decoder (each storage
    once, parameters left out), attributed to the innermost part running when it was saved."""
    params = set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params.add(local.untyped_storage().data_ptr())
    seen: dict[int, tuple[str, int]] = {}
    running: list[str] = []
    handles = []
    for path, module in model.named_modules():
        part = _part(path)
        if part is not None:
            handles.append(module.register_forward_pre_hook(lambda m, a, part=part: running.append(part) and None))
            handles.append(module.register_forward_hook(lambda m, a, o: running.pop() and None))

    def pack(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (running[-1] if running else "rest", storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    for h in handles:
        h.remove()
    return {part: sum(n for p, n in seen.values() if p == part) for part in PARTS}


def activation_worker(rank: int, world: int, payload: dict) -> dict:
    """--tp: saved activations and step peak RSS at tp_size 1, tp_size N, tp_size N with SP."""
    import torch.distributed as dist

    import hp_rewrite
    from hp_rewrite.loading.patch import rewrite_model
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.tiny import build_tiny_model

    torch.set_num_threads(1)
    args = argparse.Namespace(**payload)
    base = build_tiny_model(config(args), seed=0).train()
    out = {}
    for mode, tp, sp in (("ep", 1, False), ("tp", args.tp, False), ("tp+sp", args.tp, True)):
        plan = parse_plan(f"version: 1\nep_size: {args.ep}\ntp_size: {tp}\n"
                          f"sequence_parallel: {'true' if sp else 'false'}\n")
        model = rewrite_model(copy.deepcopy(base), plan, artifact_dir=Path(args.artifacts))
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank // tp))

        def step(model=model, ids=ids):
            model(input_ids=ids, labels=ids).loss.backward()

        Path("/proc/self/clear_refs").write_text("5")
        before = _rss_kb("VmRSS")
        saved = _saved_bytes(model, step)
        out[mode] = {"saved": saved, "total": sum(saved.values()), "step_peak_rss": (_rss_kb("VmHWM") - before) * 1024}
        hp_rewrite.sync_gradients(model)
        del model
        dist.barrier()
    return out


def activation_report(args, ranks) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"activations per rank, {args.nproc} ranks, EP={args.ep}, sequence {args.seq} x batch "
                        f"{args.batch} per TP group")
    cols = ["rank", "mode", *(f"{p} MB (vs tp 1)" for p in PARTS), "total MB (vs tp 1)", "step peak RSS MB"]
    for col in cols:
        table.add_column(col, justify="right")

    def cell(now: int, then: int) -> str:
        return f"{now / 1e6:.1f} ({now / then:.2f})" if then else f"{now / 1e6:.1f}"

    for rank, r in enumerate(ranks):
        for mode in ("ep", "tp", "tp+sp"):
            m, ep = r[mode], r["ep"]
            table.add_row(str(rank), mode if mode == "ep" else f"{mode} (tp {args.tp})",
                          *(cell(m["saved"][p], ep["saved"][p]) for p in PARTS), cell(m["total"], ep["total"]),
                          f"{m['step_peak_rss'] / 1e6:.1f}")
    Console().print(table)


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from hp_rewrite.launch import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--artifacts", default="/tmp/hp-rewrite-train-memory")
    parser.add_argument("--tp", type=int, default=1, help="measure activations at tp_size 1, N, N with SP")
    parser.add_argument("--json")
    args = parser.parse_args()
    payload = {k: v for k, v in vars(args).items() if k not in ("nproc", "json")}
    if args.tp > 1:
        ranks = run_world(args.nproc, "tools.measure_train_memory:activation_worker", payload, timeout=1800)
        activation_report(args, ranks)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": ranks}, indent=2))
        return
    ranks = run_world(args.nproc, "tools.measure_train_memory:worker", payload, timeout=1800)
    table = Table(title=f"training memory per rank, {args.nproc} ranks, EP={args.ep} "
                        f"({ranks[0]['dense_params'] / 1e6:.1f} M non-expert + {ranks[0]['expert_params'] / 1e6:.1f} M "
                        "expert parameters)")
    for col in ("rank", "mode", "params MB", "grads MB", "AdamW MB", "total MB", "target MB", "total / target",
                "step peak RSS MB"):
        table.add_column(col, justify="right")
    for rank, r in enumerate(ranks):
        for mode in ("replicated", "fully_shard"):
            m, target = r[mode], r[f"target_{mode}"]
            table.add_row(str(rank), mode, f"{m['params'] / 1e6:.1f}", f"{m['grads'] / 1e6:.1f}",
                          f"{m['adamw'] / 1e6:.1f}", f"{m['total'] / 1e6:.1f}", f"{target / 1e6:.1f}",
                          f"{m['total'] / target:.3f}", f"{m['step_peak_rss'] / 1e6:.1f}")
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": ranks}, indent=2))


if __name__ == "__main__":
    main()
