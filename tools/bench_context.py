"""Context parallelism (Ulysses, plan ``cp_size``): activations, step time and wire bytes per rank.

On ``--nproc`` gloo ranks (CPU, fp32, one thread a rank), the Qwen3-MoE config of
tools/measure_train_memory.py (small vocabulary, so the LM head's logits do not hide the rest) at EP
``--ep`` runs one sequence of ``--seq`` tokens per context group, forward and backward with transformers'
loss, at ``cp_size`` 1 (every rank its own sequence: plain EP) and at each ``--cp`` (the ranks of a
group share one sequence). Each rank reports:

* the bytes autograd saved for backward, by the decoder part that saved them (norms, attention, MoE block;
  the rest: embedding, the gathered last hidden state, final norm, LM head, loss), each storage once,
  parameters left out: the activations a step holds at its peak. The split parts should scale ~1/cp;
  the rest does not (the head runs on the whole sequence on every rank);
* the peak RSS growth of the step (kernel high-water mark, reset before it);
* the median over ``--iters`` steps of the wall time and the process CPU time. Per rank a cp step works on
  1/cp of a sequence, so the ratio to compare with 1/cp is the step time at cp N over cp 1's; with more
  ranks than cores (4 on a 2-core machine) read the CPU time;
* the bytes handed to collectives (``all_to_all_single``'s and ``all_gather``'s input buffers): in the
  forward by part (the attention's are Ulysses' exchange, the MoE block's the expert exchange, the rest the
  gather of the last hidden state), and the whole step's (forward and backward).

``--logits local`` runs the context-parallel steps with the plan's ``context.logits: local`` (the head on
this rank's positions; cp 1 is the same either way); with a large ``--vocab`` the head's share shows.

    python tools/bench_context.py                        # 4 ranks, EP 4, cp 2 and 4, 4096 tokens
    python tools/bench_context.py --seq 1024 --iters 1   # quick
    python tools/bench_context.py --vocab 32768 --logits local
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.measure_train_memory import PARTS, _part, _rss_kb, _saved_bytes, config  # noqa: E402


class _WireBytes:
    """Counts the input bytes of ``all_to_all_single`` / ``all_gather`` while installed: in the forward by the
    decoder part running (the rest: the gather of the last hidden state, the same-batch check), and the
    backward's in all (each all-to-all's backward is the reverse exchange of the same bytes)."""

    def __init__(self, model) -> None:
        import torch.distributed as dist

        self.dist, self.running, self.bytes = dist, [], dict.fromkeys((*PARTS, "step"), 0)
        self.forward = True  # set False by the caller before the backward
        self.handles = []
        for path, module in model.named_modules():
            part = _part(path)
            if part is not None:
                self.handles.append(module.register_forward_pre_hook(
                    lambda m, a, part=part: self.running.append(part) and None))
                self.handles.append(module.register_forward_hook(lambda m, a, o: self.running.pop() and None))
        self.originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather")}
        dist.all_to_all_single = self._counted(self.originals["all_to_all_single"], lambda a: a[1])
        dist.all_gather = self._counted(self.originals["all_gather"], lambda a: a[1])

    def _counted(self, fn, sent):
        def call(*args, **kwargs):
            t = sent(args)
            n = t.numel() * t.element_size()
            self.bytes["step"] += n
            if self.forward:
                self.bytes[self.running[-1] if self.running else "rest"] += n
            return fn(*args, **kwargs)
        return call

    def remove(self) -> dict[str, int]:
        for name, fn in self.originals.items():
            setattr(self.dist, name, fn)
        for h in self.handles:
            h.remove()
        return self.bytes


def worker(rank: int, world: int, payload: dict) -> dict:
    import torch.distributed as dist

    import hp_rewrite
    from hp_rewrite.loading.patch import rewrite_model
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.tiny import build_tiny_model

    torch.set_num_threads(1)
    args = argparse.Namespace(**payload)
    base = build_tiny_model(config(args), seed=0).train()
    out = {}
    for cp in (1, *args.cp):
        local = f"context:\n  logits: {args.logits}\n" if cp > 1 else ""
        plan = parse_plan(f"version: 1\nep_size: {args.ep}\ncp_size: {cp}\n{local}")
        model = rewrite_model(copy.deepcopy(base), plan, artifact_dir=Path(args.artifacts))
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(rank // cp))

        def step(model=model, ids=ids):
            model(input_ids=ids, labels=ids).loss.backward()

        step()  # warm-up (and the first forward's same-batch check)
        model.zero_grad(set_to_none=True)
        Path("/proc/self/clear_refs").write_text("5")
        before = _rss_kb("VmRSS")
        saved = _saved_bytes(model, step)
        peak = (_rss_kb("VmHWM") - before) * 1024
        wire = _WireBytes(model)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        wire.forward = False
        loss.backward()
        sent = wire.remove()
        walls, cpus = [], []
        for _ in range(args.iters):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            w, c = time.perf_counter(), time.process_time()
            step()
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        hp_rewrite.sync_gradients(model)
        out[str(cp)] = {"saved": saved, "total": sum(saved.values()), "step_peak_rss": peak, "wire": sent,
                        "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}
        del model
        dist.barrier()
    return out


def report(args, ranks) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"context parallelism per rank, {args.nproc} ranks, EP={args.ep}, one sequence of "
                        f"{args.seq} tokens per context group, {args.logits} logits (ratios vs cp 1)")
    for col in ("rank", "cp", *(f"{p} MB" for p in PARTS), "saved MB", "peak RSS MB", "wall s", "CPU s",
                "attention fwd wire MB", "MoE fwd wire MB", "rest fwd wire MB", "step wire MB"):
        table.add_column(col, justify="right")

    def cell(now: float, then: float, scale: float = 1e6, fmt: str = ".1f") -> str:
        return f"{now / scale:{fmt}} ({now / then:.2f})" if then else f"{now / scale:{fmt}}"

    for rank, r in enumerate(ranks):
        one = r["1"]
        for cp in ("1", *map(str, args.cp)):
            m = r[cp]
            table.add_row(str(rank), cp, *(cell(m["saved"][p], one["saved"][p]) for p in PARTS),
                          cell(m["total"], one["total"]), cell(m["step_peak_rss"], one["step_peak_rss"]),
                          cell(m["wall_s"], one["wall_s"], 1, ".2f"), cell(m["cpu_s"], one["cpu_s"], 1, ".2f"),
                          *(f"{m['wire'][p] / 1e6:.1f}" for p in ("attention", "moe", "rest")),
                          cell(m["wire"]["step"], one["wire"]["step"]))
    Console().print(table)


def main() -> None:
    from hp_rewrite.launch import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--logits", choices=["whole", "local"], default="whole")
    parser.add_argument("--artifacts", default="/tmp/hp-rewrite-bench-context")
    parser.add_argument("--json")
    args = parser.parse_args()
    payload = {k: v for k, v in vars(args).items() if k not in ("nproc", "json")}
    ranks = run_world(args.nproc, "tools.bench_context:worker", payload, timeout=3600)
    report(args, ranks)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": ranks}, indent=2))


if __name__ == "__main__":
    main()
