"""End-to-end training-step benchmark: hp-rewrite EP vs transformers native EP vs the unmodified model.

Why: ``tools/bench_experts.py`` measures only the local expert compute. What a user pays for is the whole
forward + backward step of the model on each rank, with the routing, the all-to-all exchanges, the attention
and the gradient synchronisation. This script measures that step for one Qwen3-MoE-shaped model on 2 local
gloo ranks (CPU, fp32, ``torch.set_num_threads(1)`` per rank), in one run, on the same weights and data:

  a. ``hp-ep2``          hp-rewrite EP=2: the model built with a fixed seed (same weights on every rank),
                         ``analyze`` -> ``write`` -> ``install`` with plan ``version: 1 / ep_size: 2``; each rank
                         runs its own batch. The step ends with one all-reduce (sum) of the replicated (non-expert)
                         gradients (``sync_gradients``' way), so that the step does the same work as (b), whose
                         FSDP reduce-scatters every gradient inside ``backward``.
  a1. ``hp-ep2-overlap-sync`` the same, with the gradients synchronised during backward by ``GradientSync``
                         (what ``hp_rewrite.gradient_sync(model)`` returns): 25 MB buckets, as DDP does.
  a2. ``hp-ep2-chunksN`` the same with ``runtime: {chunks: N}`` (``--hp-chunks``).
  a3. ``hp-ep2-balanced`` the same with ``placement: {strategy: balanced, profile: ...}``: before the ranks start,
                         ``hp-rewrite profile``'s recorder counts the tokens per expert of the seeded model on a
                         *calibration* set (``--calibration-seqs`` sequences, 16 by default; token ids drawn with
                         another seed, so it never sees the timed tokens), and each layer's experts are spread
                         over the ranks to even out that load (``--no-balanced``: skip). This random-weight
                         model routes very differently from one batch of 4 sequences to the next, so a static
                         placement can only remove the part of the imbalance that the calibration set shares.
  a4. ``hp-ep2-no-dedup``, ``hp-ep2-balanced-no-dedup`` (``--compare-dedup``): the same with ``runtime: {dedup:
                         false}``, the plain exchange (one row per routed slot, weighted sum on the sender).
  a5. ``hp-ep2-interleaveN``, ``hp-ep2-balanced-interleaveN`` (``--interleave N``, 2 by default, 1: none): the
                         rank's batch split into N micro-batches whose forward + loss + backward run through
                         a kept ``hp_rewrite.Interleaver`` (taking turns at the exchanges); the gradient
                         all-reduce after. ``--fresh-threads`` adds ``hp-ep2-interleaveN-fresh-threads``:
                         ``hp_rewrite.interleave`` every step, which starts new worker threads each time.
  a6. ``hp-ep2-defer``, ``hp-ep2-balanced-defer`` (``--defer``; with ``--interleave N`` also
                         ``hp-ep2-balanced-defer-interleaveN``): the same with ``runtime: {defer_expert_grads:
                         true}``, the experts' weight-gradient GEMMs run in the backward's exchange waits and at
                         its end.
  a7. ``hp-ep2-defer-overlap-sync``, ``hp-ep2-balanced-defer-overlap-sync`` (``--defer``): a6 with the
                         gradients synchronised by ``GradientSync`` as in a1 (the replicated buckets' all-reduce
                         runs while the deferred jobs left at the end of backward are computed).
  ``--only PATTERN ...`` keeps only the hp-rewrite variants whose names match (fnmatch); the others always run.
  b. ``native-ep2``      transformers' own EP: ``from_pretrained(ckpt, distributed_config=DistributedConfig(
                         ep_size=2, fsdp_size=2))`` from a checkpoint written once by ``save_pretrained``: experts
                         sharded over EP with the all-to-all token dispatch (``AllToAllEP``), dense weights
                         FSDP2-sharded (all-gathered per layer in forward and again in backward, gradients
                         reduce-scattered). ``fsdp_size=2`` is required: ``ep_size`` must divide ``fsdp_size * tp_size``.
  c. ``unmodified-b2``   the unmodified model, one process, this rank's batch of 2 sequences.
  c4. ``unmodified-b4``  the unmodified model, one process, both ranks' batches (4 sequences). Its logits and
                         gradients are the reference every other variant is checked against.

Each step: gradients set to None, ``logits = model(input_ids).logits``, ``loss = cross_entropy(logits, labels,
reduction="sum") / (all tokens of both ranks)``, ``loss.backward()`` (+ the gradient all-reduce of a). With this
loss the summed gradients over the ranks equal the gradients of the unmodified model on the 4 sequences; FSDP2
averages over its 2 ranks, so native gradients are multiplied by 2 before comparing. No optimizer step: every
iteration computes the same thing, so the warm-up iteration's outputs are the ones checked.

Variants run round-robin inside the same two worker processes (a, a2, b, c, c4, a, a2, ...), each step after a
barrier so both ranks start together and machine noise hits all variants alike. Reported per variant: median
and min step time over ``--iters`` timed iterations (the slower rank of each iteration; forward / backward /
gradient all-reduce split), CPU time of the step (all threads; waiting excluded), the main thread's run-queue
wait (``/proc/self/schedstat``: time other processes held the core), tokens/s per rank, time per token relative
to native EP (the issue's target: hp-rewrite <= 0.8x) by median, by the median of per-iteration paired ratios,
by min, by CPU time and after subtracting run-queue waits; minor page faults per step; parameter bytes held per
rank, the step's peak RSS growth (the kernel's high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs``
after ``malloc_trim``; ``ru_maxrss`` deltas as a fallback; measured in ``--memory-rounds`` untimed rounds, since
timed steps do not trim unless ``--trim-every-step``: a trimmed step page-faults its whole working set again), the max relative error (max |x - ref| / max |ref|) of
logits and gradients against ``unmodified-b4``, and the rows each EP rank's experts receive per layer (load
imbalance shows up as waiting in every EP variant). On a shared machine, read the paired, min and CPU ratios.

Run (from the repo root, virtualenv active)::

    python tools/bench_e2e.py                                  # full size, 3 timed iterations
    python tools/bench_e2e.py --seq 64 --hidden 128 --layers 2 --moe-intermediate 64 --iters 1   # quick
    python tools/bench_e2e.py --profile                        # + torch.profiler top ops of a and b per rank

Results go to ``--out`` (default ``bench-results/bench_e2e.json``): the exact command, versions, sizes,
per-rank per-iteration times, memory, agreement and (with ``--profile``) the profiler tables.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import fnmatch
import functools
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_rewrite.runtime import installed

REPO = Path(__file__).resolve().parents[1]
HP = "hp-ep2"
BALANCED = "hp-ep2-balanced"
OVERLAP_SYNC = "hp-ep2-overlap-sync"
NATIVE = "native-ep2"
UNMOD2 = "unmodified-b2"
REFERENCE = "unmodified-b4"
WORLD = 2
EP_SIZE = 2
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLIBC_TUNABLES", "LD_PRELOAD")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512, help="hidden_size")
    p.add_argument("--layers", type=int, default=4, help="num_hidden_layers (all MoE)")
    p.add_argument("--experts", type=int, default=16, help="num_experts")
    p.add_argument("--top-k", type=int, default=4, help="num_experts_per_tok")
    p.add_argument("--moe-intermediate", type=int, default=256, help="moe_intermediate_size")
    p.add_argument("--heads", type=int, default=8, help="num_attention_heads")
    p.add_argument("--kv-heads", type=int, default=4, help="num_key_value_heads")
    p.add_argument("--head-dim", type=int, default=64, help="head_dim")
    p.add_argument("--vocab", type=int, default=1024, help="vocab_size")
    p.add_argument("--seq", type=int, default=512, help="sequence length")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention implementation (all variants)")
    p.add_argument("--hp-chunks", type=int, nargs="*", default=[2],
                   help="extra hp-rewrite variants with runtime.chunks = N (none: --hp-chunks with no value)")
    p.add_argument("--no-balanced", dest="balanced", action="store_false",
                   help="skip the hp-rewrite variant with a profile-balanced expert placement")
    p.add_argument("--tokens", choices=("uniform", "zipf"), default="uniform",
                   help="token ids of every batch: uniform over the vocabulary, or Zipf-distributed like text")
    p.add_argument("--calibration-seqs", type=int, default=16,
                   help="sequences of the calibration set the balanced placement is profiled on")
    p.add_argument("--interleave", type=int, default=2,
                   help="add hp-ep2-interleaveN (and hp-ep2-balanced-interleaveN): the rank's batch split into N "
                        "micro-batches run by a kept hp_rewrite.Interleaver (1: none)")
    p.add_argument("--fresh-threads", action="store_true",
                   help="add hp-ep2-interleaveN-fresh-threads: hp_rewrite.interleave every step (new worker threads "
                        "each time) instead of a kept Interleaver")
    p.add_argument("--compare-dedup", action="store_true",
                   help="add hp-ep2-no-dedup (and hp-ep2-balanced-no-dedup): runtime.dedup false, one row per slot")
    p.add_argument("--defer", action="store_true",
                   help="add hp-ep2-defer and hp-ep2-balanced-defer, the same with GradientSync "
                        "(...-defer-overlap-sync) and, with --interleave N, hp-ep2-balanced-defer-interleaveN: "
                        "runtime.defer_expert_grads true")
    p.add_argument("--only", nargs="+", metavar="PATTERN",
                   help="keep only the hp-rewrite variants matching these fnmatch patterns (native EP and the "
                        "unmodified model always run)")
    p.add_argument("--oracle-placement", action="store_true",
                   help="diagnostic: balance the placement on the timed batch itself (a bound, not a fair result)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per variant (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per variant (the first is checked)")
    p.add_argument("--memory-rounds", type=int, default=1,
                   help="untimed iterations per variant, after the warm-up, that measure the step's peak RSS growth "
                        "(each after malloc_trim)")
    p.add_argument("--trim-every-step", action="store_true",
                   help="malloc_trim before every timed step as well (the method of the earlier runs): every timed "
                        "step then page-faults its whole working set again")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also profile one step of hp-ep2 and native-ep2")
    p.add_argument("--profile-rows", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps per variant (interleaved), averaged")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the world is killed")
    p.add_argument("--out", type=Path, default=Path("bench-results/bench_e2e.json"))
    a = p.parse_args(argv)
    if a.memory_rounds < 1 and not a.trim_every_step:
        p.error("--memory-rounds must be >= 1 (or pass --trim-every-step): the memory columns need a measured step")
    if a.warmup < 1:
        p.error("--warmup must be >= 1: the first iteration's outputs are the ones checked")
    return a


def model_config(sizes: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=4 * sizes["hidden"],
        moe_intermediate_size=sizes["moe_intermediate"], num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"], head_dim=sizes["head_dim"],
        num_experts=sizes["experts"], num_experts_per_tok=sizes["top_k"], norm_topk_prob=True,
        max_position_embeddings=max(4096, sizes["seq"]), tie_word_embeddings=False, use_cache=False,
    )


def build_model(sizes: dict, seed: int, attn: str):
    """The unmodified model, its weights a function of ``seed`` only (same on every rank and in the parent)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(sizes), attn_implementation=attn, dtype=torch.float32)
    return model.train()


def quiet() -> None:
    """No progress bars, and not DTensor's once-per-rank note on the 2-step all-gather of expert gradients."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


# ----------------------------------------------------------------------------- memory


class MemoryProbe:
    """Peak RSS growth of one step: reset the kernel's high-water mark, run, read it back."""

    def __init__(self) -> None:
        self.libc = None
        with contextlib.suppress(OSError):
            self.libc = ctypes.CDLL("libc.so.6")
        self.can_reset = self._reset_hwm()
        self.method = "VmHWM reset via /proc/self/clear_refs" if self.can_reset else "ru_maxrss delta"

    @staticmethod
    def _status_kb(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def rss_mb(self) -> float:
        return self._status_kb("VmRSS") / 1024

    def start(self, trim: bool = True) -> None:
        if trim and self.libc is not None:
            self.libc.malloc_trim(0)  # free heap pages back to the OS, so RSS is the live set
        self.before_mb = self.rss_mb()
        if self.can_reset:
            self._reset_hwm()
        else:
            self.maxrss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def stop(self) -> dict:
        if self.can_reset:
            peak = self._status_kb("VmHWM") / 1024
        else:  # only growth beyond the process's previous peak is visible
            peak = max(self.before_mb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return {"rss_before_mb": self.before_mb, "peak_rss_mb": peak, "step_growth_mb": peak - self.before_mb}


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (the local shard of a DTensor)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


# ----------------------------------------------------------------------------- variants


def runqueue_s() -> float:
    """Seconds the main thread has spent runnable but waiting for a CPU (``/proc/self/schedstat``; 0 if absent)."""
    try:
        return int(Path("/proc/self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def loss_of(logits: torch.Tensor, labels: torch.Tensor, denom: int) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / denom


def expert_param_names(model: torch.nn.Module) -> set[str]:
    """Parameters of hp-rewrite's installed experts holders (sharded over EP, not replicated)."""
    names = set()
    for mod_name, mod in model.named_modules():
        if installed.binding(mod) is not None:
            names.update(f"{mod_name}.{w}" for w in installed.layout(mod).weight_names)
    return names


class Variant:
    """One model and how to run a training step on it; ``step`` returns timings and keeps the last outputs."""

    def __init__(self, name: str, model, ids: torch.Tensor, labels: torch.Tensor, denom: int,
                 grad_sync: list[torch.nn.Parameter] | None = None, overlapped_sync=None,
                 micro_batches: int = 1, fresh_threads: bool = False) -> None:
        self.name, self.model, self.ids, self.labels, self.denom = name, model, ids, labels, denom
        self.grad_sync = grad_sync
        self.micro_batches = micro_batches  # > 1: a kept hp_rewrite.Interleaver over that many micro-batches
        self.interleaver = None
        if micro_batches > 1:
            from hp_rewrite import Interleaver, interleave

            # a kept Interleaver: its worker thread (and malloc arena) lives from step to step;
            # fresh_threads: hp_rewrite.interleave, new threads every step (for comparison)
            self.interleaver = Interleaver() if not fresh_threads else SimpleNamespace(run=interleave)
        self.overlapped_sync = overlapped_sync  # hp_rewrite.gradient_sync: all-reduces during backward
        self.logits: torch.Tensor | None = None

    def step(self) -> dict:
        for p in self.model.parameters():
            p.grad = None
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        q0, c0, t0 = runqueue_s(), time.process_time(), time.perf_counter()
        if self.interleaver is not None:  # forward + backward of each micro-batch, taking turns at the exchanges
            def micro_step(ids, labels):
                out = self.model(input_ids=ids, use_cache=False).logits
                loss_of(out, labels, self.denom).backward()
                return out.detach()

            parts = zip(self.ids.chunk(self.micro_batches), self.labels.chunk(self.micro_batches), strict=True)
            logits = torch.cat(self.interleaver.run([functools.partial(micro_step, i, lab) for i, lab in parts]))
            t1 = t2 = time.perf_counter()  # one interleaved phase: reported as forward, backward 0
        else:
            logits = self.model(input_ids=self.ids, use_cache=False).logits
            loss = loss_of(logits, self.labels, self.denom)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
        if self.overlapped_sync is not None:
            self.overlapped_sync.wait()
        if self.grad_sync:
            grads = [p.grad for p in self.grad_sync]
            flat = torch.cat([g.reshape(-1) for g in grads])  # one bucket, one collective
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        t3 = time.perf_counter()
        self.logits = logits.detach()
        cpu = time.process_time() - c0  # every thread of the process (gloo's included); not time spent waiting
        runq = runqueue_s() - q0  # main thread runnable but not running: other processes had the core
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0  # first touches of fresh pages, all threads
        return {"step_s": t3 - t0, "forward_s": t1 - t0, "backward_s": t2 - t1, "grad_sync_s": t3 - t2, "cpu_s": cpu,
                "runqueue_s": runq, "page_faults": faults}


def build_hp(name: str, ref_model, plan_text: str, out_dir: Path, ids, labels, denom,
             overlap: bool = False, micro_batches: int = 1, fresh_threads: bool = False) -> tuple[Variant, dict]:
    from hp_rewrite.plan import parse_plan
    from hp_rewrite.rewrite import analyze, install, write
    from hp_rewrite.runtime.group.groups import build_expert_parallel_group

    plan = parse_plan(plan_text)
    model = copy.deepcopy(ref_model)  # the seeded weights, identical on every rank
    analysis = analyze(model, plan)
    artifact = write(analysis, plan, model.config, out_dir)
    ep = build_expert_parallel_group(plan.ep_size)
    patched = install(model, artifact, plan, ep)
    experts = expert_param_names(model)
    replicated = [p for n, p in model.named_parameters() if n not in experts and p.requires_grad]
    from hp_rewrite.runtime.compute.experts import resolve_compute

    experts_module = model.get_submodule(patched[0]).experts if patched else None
    w = next(experts_module.parameters()) if experts_module is not None else None
    info = {"plan": plan_text, "patched": patched, "options": plan.runtime.to_options().as_dict(),
            "compute_resolved": None if w is None else resolve_compute(
                plan.runtime.to_options().compute, torch.empty(1, w.shape[-1]), w),
            "archetype": analysis.matched[0].archetype.as_dict() if analysis.matched else None,
            "artifact": str(artifact.directory)}
    if not overlap:  # the replicated gradients' all-reduce (sum) after backward, in one bucket
        return Variant(name, model, ids, labels, denom, grad_sync=replicated, micro_batches=micro_batches,
                       fresh_threads=fresh_threads), info
    # hp_rewrite.gradient_sync: buckets all-reduced during backward. It averages over the world (the
    # contract for a per-rank mean loss); this loss is already divided by both ranks' tokens, so its
    # gradients are half the sum, and the checks scale them by the world size.
    from hp_rewrite.sync.gradients import GradientSync

    return Variant(name, model, ids, labels, denom, overlapped_sync=GradientSync(model, ep)), info


def build_native(ckpt: Path, attn: str, ids, labels, denom) -> tuple[Variant, dict]:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dc = DistributedConfig(ep_size=EP_SIZE, fsdp_size=WORLD)
    model = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=dc, dtype=torch.float32,
                                                 attn_implementation=attn).train()
    impls = set()  # the EPImplementation each dispatched experts module closes over
    for m in model.modules():
        for cell in getattr(m.forward, "__closure__", None) or ():
            with contextlib.suppress(ValueError):
                if type(cell.cell_contents).__name__.endswith("EP"):
                    impls.add(type(cell.cell_contents).__name__)
    info = {"distributed_config": dc.to_dict(), "experts_implementation": model.config._experts_implementation,
            "ep_implementations": sorted(impls)}
    return Variant(NATIVE, model, ids, labels, denom), info


# ----------------------------------------------------------------------------- agreement


def max_rel(x: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    return ((x.float() - ref.float()).abs().max() / max(ref.abs().max().item(), floor)).item()


def full_grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    return g.full_tensor() if hasattr(g, "full_tensor") else g  # collective for DTensors: same order on all ranks


def grad_errors(variant: Variant, ref_grads: dict[str, torch.Tensor], scale: float, expert_names: set[str],
                probe: str) -> dict:
    """Per-parameter max rel error vs the reference gradients (floor: 1e-3 x the largest reference grad)."""
    floor = 1e-3 * max(g.abs().max().item() for g in ref_grads.values())
    errs = {}
    for name, p in variant.model.named_parameters():
        g = full_grad(p)
        ref = ref_grads[name]
        if name in expert_names:  # this rank's experts of that layer (the placement may differ per layer)
            owner = variant.model.get_submodule(name.rsplit(".", 1)[0])
            ref = ref[installed.binding(owner).placement.local_index]
        errs[name] = max_rel(torch.zeros_like(ref) if g is None else g * scale, ref, floor)
    worst = max(errs, key=errs.get)
    experts = [e for n, e in errs.items() if n.endswith(("gate_up_proj", "down_proj")) and ".experts." in n]
    return {"max": errs[worst], "worst": worst, "max_expert": max(experts, default=None),
            "replicated_probe": {"name": probe, "err": errs.get(probe)}}


# ----------------------------------------------------------------------------- worker


def worker(rank: int, world: int, payload: dict) -> dict:
    """One rank: build every variant, time them round-robin, check them against the unmodified model."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"})
    torch.set_num_threads(payload["threads"])
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    quiet()
    sizes, seed, attn = payload["sizes"], payload["seed"], payload["attn"]
    mem = MemoryProbe()
    base_rss_mb = mem.rss_mb()

    batch, seq, vocab = sizes["batch"], sizes["seq"], sizes["vocab"]
    gen = torch.Generator().manual_seed(seed + 1)
    all_ids = token_ids(payload["tokens"], vocab, (world * batch, seq), gen)
    all_labels = token_ids(payload["tokens"], vocab, (world * batch, seq), gen)
    mine = slice(rank * batch, (rank + 1) * batch)
    denom = world * batch * seq  # every rank's tokens: summed over ranks = the mean over the global batch
    ids, labels = all_ids[mine].contiguous(), all_labels[mine].contiguous()

    ref_model = build_model(sizes, seed, attn)
    variants: list[Variant] = []
    info: dict[str, dict] = {}
    errors: dict[str, str] = {}
    out_dir = Path(payload["tmp"]) / f"artifacts-rank{rank}"
    plans = {HP: f"version: 1\nep_size: {EP_SIZE}\n"}
    for c in payload["hp_chunks"]:
        plans[f"{HP}-chunks{c}"] = f"version: 1\nep_size: {EP_SIZE}\nruntime:\n  chunks: {c}\n"
    plans[OVERLAP_SYNC] = plans[HP]
    if payload["profile_path"]:
        plans[BALANCED] = (f"version: 1\nep_size: {EP_SIZE}\nplacement:\n  strategy: balanced\n"
                           f"  profile: {json.dumps(payload['profile_path'])}\n")
    if payload["compare_dedup"]:  # the plain exchange: one row per routed slot
        for name in [n for n in plans if n in (HP, BALANCED)]:
            plans[f"{name}-no-dedup"] = plans[name] + "runtime:\n  dedup: false\n"
    if payload["defer"]:  # expert weight gradients in the backward's exchange waits
        for name in [n for n in plans if n in (HP, BALANCED)]:
            plans[f"{name}-defer"] = plans[name] + "runtime:\n  defer_expert_grads: true\n"
            plans[f"{name}-defer-overlap-sync"] = plans[f"{name}-defer"]  # + GradientSync during backward
    micro = {}
    if payload["interleave"] > 1:  # the same plans, the batch split into micro-batches that take turns
        for name in [n for n in plans if n in (HP, BALANCED, f"{BALANCED}-defer")]:
            micro[f"{name}-interleave{payload['interleave']}"] = plans[name]
        if payload["fresh_threads"]:
            micro[f"{HP}-interleave{payload['interleave']}-fresh-threads"] = plans[HP]
        plans.update(micro)
    if payload["only"]:
        unmatched = [pat for pat in payload["only"] if not fnmatch.filter(plans, pat)]
        if unmatched:  # a typo would silently drop a variant from the comparison
            raise ValueError(f"--only {' '.join(unmatched)}: matches no hp-rewrite variant of this run; "
                             f"the variants are: {', '.join(plans)}")
        plans = {n: t for n, t in plans.items() if any(fnmatch.fnmatch(n, pat) for pat in payload["only"])}
    for name, text in plans.items():
        v, info[name] = build_hp(name, ref_model, text, out_dir, ids, labels, denom, overlap=name.endswith("overlap-sync"),
                                 micro_batches=payload["interleave"] if name in micro else 1,
                                 fresh_threads=name.endswith("-fresh-threads"))
        variants.append(v)
    try:
        v, info[NATIVE] = build_native(Path(payload["ckpt"]), attn, ids, labels, denom)
        variants.append(v)
    except Exception:  # noqa: BLE001 - report why native EP cannot run, keep measuring the rest
        errors[NATIVE] = traceback.format_exc()
    unmod2 = Variant(UNMOD2, copy.deepcopy(ref_model), ids, labels, denom)
    ref = Variant(REFERENCE, ref_model, all_ids, all_labels, denom)
    variants += [unmod2, ref]
    for v in variants:
        info.setdefault(v.name, {})["param_mb"] = param_bytes(v.model) / 2**20
        info[v.name]["tokens_per_step"] = v.ids.numel()

    # ---- routing of the reference step: how many rows each EP rank's experts get (its compute, and the waits)
    routed: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda _m, _i, out, name=n: routed.__setitem__(name, out[2].detach()))
             for n, m in ref.model.named_modules() if n.endswith("mlp.gate")]

    # ---- timing, round-robin; the first iteration's outputs are checked
    times: dict[str, list[dict]] = {v.name: [] for v in variants}
    memory: dict[str, list[dict]] = {v.name: [] for v in variants}
    agreement: dict[str, dict] = {}
    # Memory rounds come first after the warm-up: each step after malloc_trim, so its RSS growth is its live
    # set. Timed steps do not trim (a training loop does not), unless --trim-every-step asks for the old method.
    trim_timed = payload["trim_every_step"]
    rounds = ["warmup"] * payload["warmup"] + ["memory"] * payload["memory_rounds"] + ["timed"] * payload["iters"]
    for it, kind in enumerate(rounds):
        for v in variants:
            dist.barrier()
            mem.start(trim=kind == "memory" or trim_timed)
            t = v.step()
            m = mem.stop()
            if kind == "timed":
                times[v.name].append(t)
            if kind == "memory" or (kind == "timed" and trim_timed):
                memory[v.name].append(m)
        if it == 0:
            agreement = check(variants, ref, mine)
            for h in hooks:
                h.remove()

    per_rank = sizes["experts"] // EP_SIZE
    load = {n: torch.bincount(idx.reshape(-1) // per_rank, minlength=EP_SIZE).tolist() for n, idx in routed.items()}
    balanced = next((v for v in variants if v.name == BALANCED), None)
    load_balanced = {}
    if balanced is not None:  # the same routed rows, grouped by the balanced placement's owner ranks
        for n, idx in routed.items():
            placement = installed.binding(balanced.model.get_submodule(n.removesuffix(".gate") + ".experts")).placement
            owner = torch.tensor(placement.slot_of_expert) // placement.num_local
            load_balanced[n] = torch.bincount(owner[idx.reshape(-1)], minlength=EP_SIZE).tolist()
    result = {"rank": rank, "times": times, "memory": memory, "info": info, "agreement": agreement, "ep_load": load,
              "ep_load_balanced": load_balanced,
              "errors": errors, "base_rss_mb": base_rss_mb, "memory_method": mem.method,
              "process_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if payload["profile"]:
        result["profile"] = profile([v for v in variants if v.name in (HP, f"{HP}-no-dedup", NATIVE, UNMOD2)], payload["profile_rows"],
                                    payload["profile_steps"])
    return result


def check(variants: list[Variant], ref: Variant, mine: slice) -> dict:
    """Logits and gradients of every variant against the unmodified model on both ranks' batches."""
    ref_logits = ref.logits[mine]
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.model.named_parameters() if p.grad is not None}
    probe = "model.layers.0.self_attn.q_proj.weight"
    out = {}
    for v in variants:
        if v is ref:
            continue
        entry = {"logits_max_rel": max_rel(v.logits, ref_logits)}
        if v.name.startswith(HP):  # gradient_sync averages over the world: x2 gives the sum
            scale = float(WORLD) if v.overlapped_sync is not None else 1.0
            entry["grads"] = grad_errors(v, ref_grads, scale, expert_param_names(v.model), probe)
        elif v.name == NATIVE:  # FSDP2 averages over its 2 ranks: x2 gives the sum
            entry["grads"] = grad_errors(v, ref_grads, float(WORLD), set(), probe)
        out[v.name] = entry
    return out


CATEGORIES = (  # first match wins; by op name, on self CPU time
    ("autograd engine", ("autograd::engine",)),
    ("matmul", ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm", "aten::baddbmm")),
    ("attention (sdpa)", ("scaled_dot_product",)),
    ("FSDP hooks", ("FSDP::",)),
    ("communication + waits", ("c10d", "AllToAll", "wait_tensor", "WaitTensor", "all_to_all", "all_gather",
                               "reduce_scatter", "allreduce", "record_param_comms")),
    ("gather / scatter / sort", ("index", "scatter", "gather", "sort", "searchsorted", "masked_fill", "nonzero",
                                 "repeat_interleave", "cumsum", "histc", "bincount", "where")),
    ("copies / fills", ("copy_", "aten::cat", "fill_", "zero_", "clone", "_to_copy", "split_with_sizes_copy",
                        "aten::empty", "contiguous", "aten::stack")),
)


def category(op: str) -> str:
    for name, keys in CATEGORIES:
        if any(k in op for k in keys):
            return name
    return "elementwise + other"


def profile(variants: list[Variant], rows: int, steps: int) -> dict:
    """Self CPU time per op, summed over ``steps`` profiled steps per variant (interleaved), then per step."""
    ops: dict[str, dict[str, list[float]]] = {v.name: {} for v in variants}
    wall: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(steps):
        for v in variants:
            dist.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                wall[v.name].append(v.step()["step_s"])
            for e in prof.key_averages():
                acc = ops[v.name].setdefault(e.key, [0.0, 0])
                acc[0] += e.self_cpu_time_total / 1e3 / steps
                acc[1] += e.count / steps
    out = {}
    for name, table in ops.items():
        total = sum(ms for ms, _ in table.values())
        cats: dict[str, float] = {}
        for op, (ms, _) in table.items():
            cats[category(op)] = cats.get(category(op), 0.0) + ms
        top = sorted(table.items(), key=lambda kv: kv[1][0], reverse=True)[:rows]
        out[name] = {
            "steps": steps, "step_s": wall[name], "self_cpu_ms_per_step": total,
            "categories_ms_per_step": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "top": [{"op": op, "calls_per_step": n, "self_ms_per_step": ms, "share": ms / total if total else 0.0}
                    for op, (ms, n) in top],
        }
    return out


def profile_text(prof: dict) -> str:
    lines = [f"{'op':<62} {'calls':>7} {'self ms':>9} {'share':>6}"]
    lines += [f"{t['op'][:62]:<62} {t['calls_per_step']:>7.0f} {t['self_ms_per_step']:>9.1f} {t['share']:>6.1%}"
              for t in prof["top"]]
    lines.append(f"{'total self CPU per step':<62} {'':>7} {prof['self_cpu_ms_per_step']:>9.1f}")
    lines.append("by category: " + ", ".join(f"{c} {ms:.0f} ms" for c, ms in prof["categories_ms_per_step"].items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- parent


def summarize(ranks: list[dict]) -> dict:
    r0 = ranks[0]
    names = list(r0["times"])
    results = {}
    for name in names:
        per_iter = [max(r["times"][name][i]["step_s"] for r in ranks) for i in range(len(r0["times"][name]))]
        parts = {k: statistics.median(max(r["times"][name][i][k] for r in ranks) for i in range(len(per_iter)))
                 for k in ("forward_s", "backward_s", "grad_sync_s")}
        no_sync = [max(t["step_s"] - t["grad_sync_s"] for t in (r["times"][name][i] for r in ranks))
                   for i in range(len(per_iter))]
        cpu = [max(r["times"][name][i]["cpu_s"] for r in ranks) for i in range(len(per_iter))]
        runq = [max(r["times"][name][i]["runqueue_s"] for r in ranks) for i in range(len(per_iter))]
        faults = [max(r["times"][name][i]["page_faults"] for r in ranks) for i in range(len(per_iter))]
        # without this rank's own run-queue wait (a peer's delay still shows up as waiting in a collective)
        adjusted = [max(r["times"][name][i]["step_s"] - r["times"][name][i]["runqueue_s"] for r in ranks)
                    for i in range(len(per_iter))]
        growth = max(m["step_growth_mb"] for r in ranks for m in r["memory"][name])
        param_mb = max(r["info"][name]["param_mb"] for r in ranks)
        base = max(r["base_rss_mb"] for r in ranks)
        agree = [r["agreement"].get(name) for r in ranks if r["agreement"].get(name)]
        results[name] = {
            "median_step_s": statistics.median(per_iter), "min_step_s": min(per_iter), "step_s_per_iter": per_iter,
            "median_cpu_s": statistics.median(cpu), "cpu_s_per_iter": cpu,
            "median_runqueue_s": statistics.median(runq), "runqueue_s_per_iter": runq,
            "median_page_faults": statistics.median(faults), "page_faults_per_iter": faults,
            "median_adjusted_step_s": statistics.median(adjusted), "adjusted_step_s_per_iter": adjusted,
            **{f"median_{k}": v for k, v in parts.items()}, "median_step_excl_grad_sync_s": statistics.median(no_sync),
            "tokens_per_step_per_rank": r0["info"][name]["tokens_per_step"],
            "param_mb_per_rank": param_mb, "step_peak_growth_mb": growth,
            "estimated_peak_rss_mb": base + param_mb + growth,
            "logits_max_rel": max((a["logits_max_rel"] for a in agree), default=None),
            "grads_max_rel": max((a["grads"]["max"] for a in agree if "grads" in a), default=None),
            "grads_worst": [a["grads"]["worst"] for a in agree if "grads" in a],
            "grads_max_rel_experts": max((a["grads"]["max_expert"] for a in agree
                                          if "grads" in a and a["grads"]["max_expert"] is not None), default=None),
            "replicated_probe": ({"name": agree[0]["grads"]["replicated_probe"]["name"],
                                  "max_rel": max(a["grads"]["replicated_probe"]["err"] for a in agree)}
                                 if agree and "grads" in agree[0] else None),
        }
    for res in results.values():
        res["tokens_per_s_per_rank"] = res["tokens_per_step_per_rank"] / res["median_step_s"]
    for res in results.values():
        if NATIVE in results:
            nat = results[NATIVE]
            per_tok = nat["tokens_per_step_per_rank"] / res["tokens_per_step_per_rank"]
            res["time_per_token_vs_native"] = nat["tokens_per_s_per_rank"] / res["tokens_per_s_per_rank"]
            # the same iteration's steps ran back to back: their ratio cancels slow drifts of the machine's load
            res["paired_ratio_vs_native_per_iter"] = [t / n * per_tok for t, n in
                                                      zip(res["step_s_per_iter"], nat["step_s_per_iter"], strict=True)]
            res["paired_ratio_vs_native_median"] = statistics.median(res["paired_ratio_vs_native_per_iter"])
            res["min_time_per_token_vs_native"] = res["min_step_s"] / nat["min_step_s"] * per_tok
            res["cpu_per_token_vs_native"] = res["median_cpu_s"] / nat["median_cpu_s"] * per_tok
            res["adjusted_paired_ratio_vs_native_median"] = statistics.median(
                t / n * per_tok for t, n in zip(res["adjusted_step_s_per_iter"], nat["adjusted_step_s_per_iter"],
                                                strict=True))
            res["time_per_token_vs_native_excl_grad_sync"] = (
                res["median_step_excl_grad_sync_s"] / res["tokens_per_step_per_rank"]
                / (nat["median_step_s"] / nat["tokens_per_step_per_rank"]))
    return results


def print_table(results: dict, a: argparse.Namespace, threads: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 250))  # no wrapped cells when piped
    table = Table(title=f"Qwen3-MoE fwd+bwd step: H={a.hidden} L={a.layers} E={a.experts} K={a.top_k} "
                        f"I_moe={a.moe_intermediate} seq={a.seq} batch/rank={a.batch} fp32 CPU gloo x{WORLD} "
                        f"threads/rank={threads} iters={a.iters}")
    table.caption = (
        "step times: the slower rank of each iteration; runq = time the main thread waited for a CPU (other "
        "processes); faults = minor page faults per step (fresh pages touched, the slower rank); vs native = time per token / native EP's (median step; median of per-iteration paired ratios; "
        "min step; CPU time, all threads; paired ratio of step minus own run-queue wait). Errors vs "
        f"{REFERENCE}: max|x-ref|/max|ref|, grads: worst parameter, summed over ranks. est. peak = base RSS + "
        "params + the step's peak RSS growth")
    cols = ("variant", "median step s", "min s", "fwd / bwd / sync s", "CPU s", "runq s", "faults k", "tokens/s/rank",
            "vs native EP: median / paired / min / CPU / runq-adj", "params MB/rank", "step +MB", "est. peak RSS MB",
            "logits rel err", "grads rel err")
    for col in cols:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, r in results.items():
        ratios = "-" if "time_per_token_vs_native" not in r else " / ".join(
            f"{r[k]:.2f}x" for k in ("time_per_token_vs_native", "paired_ratio_vs_native_median",
                                     "min_time_per_token_vs_native", "cpu_per_token_vs_native",
                                     "adjusted_paired_ratio_vs_native_median"))
        table.add_row(
            name, f"{r['median_step_s']:.3f}", f"{r['min_step_s']:.3f}",
            f"{r['median_forward_s']:.2f} / {r['median_backward_s']:.2f} / {r['median_grad_sync_s']:.2f}",
            f"{r['median_cpu_s']:.2f}", f"{r['median_runqueue_s']:.2f}", f"{r['median_page_faults'] / 1e3:.0f}",
            f"{r['tokens_per_s_per_rank']:,.0f}", ratios,
            f"{r['param_mb_per_rank']:.1f}", f"{r['step_peak_growth_mb']:.0f}", f"{r['estimated_peak_rss_mb']:.0f}",
            "ref" if name == REFERENCE else f"{r['logits_max_rel']:.1e}",
            "ref" if name == REFERENCE else "-" if r["grads_max_rel"] is None else f"{r['grads_max_rel']:.1e}")
    console.print(table)


def token_ids(kind: str, vocab: int, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Uniform ids, or ids with Zipf frequencies (p ~ 1/rank over a fixed shuffle of the vocabulary, as in text)."""
    if kind == "uniform":
        return torch.randint(0, vocab, shape, generator=gen)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    shuffle = torch.randperm(vocab, generator=torch.Generator().manual_seed(7))
    return shuffle[torch.multinomial(weights, shape[0] * shape[1], replacement=True, generator=gen)].view(shape)


def calibration_profile(model, sizes: dict, seed: int, seqs: int, tokens: str, tmp: Path, oracle: bool) -> str:
    """Tokens per expert of every layer on a calibration set the timed steps never see (another seed).

    ``oracle``: on the timed batch itself instead, a diagnostic bound (no placement fixed in advance can
    know the batch), never a fair measurement."""
    from hp_rewrite.cost.profile import routing_profile

    if oracle:  # the same draws as the workers' all_ids
        batches = [token_ids(tokens, sizes["vocab"], (WORLD * sizes["batch"], sizes["seq"]),
                             torch.Generator().manual_seed(seed + 1))]
    else:
        gen = torch.Generator().manual_seed(seed + 1000)
        batches = [token_ids(tokens, sizes["vocab"], (1, sizes["seq"]), gen) for _ in range(seqs)]
    path = tmp / "calibration-profile.json"
    path.write_text(json.dumps(routing_profile(model.eval(), batches).as_dict(EP_SIZE), indent=2))
    return str(path)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # spawned ranks import tools.bench_e2e:worker from the repo root
    import accelerate
    import transformers

    from hp_rewrite.launch import WorldError, run_world

    sizes = {"hidden": a.hidden, "layers": a.layers, "experts": a.experts, "top_k": a.top_k,
             "moe_intermediate": a.moe_intermediate, "heads": a.heads, "kv_heads": a.kv_heads,
             "head_dim": a.head_dim, "vocab": a.vocab, "seq": a.seq, "batch": a.batch}
    t0 = time.perf_counter()
    quiet()
    with tempfile.TemporaryDirectory(prefix="bench_e2e-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        model = build_model(sizes, a.seed, a.attn)
        model.save_pretrained(ckpt)  # native EP loads this, once
        profile_path = (calibration_profile(model, sizes, a.seed, a.calibration_seqs, a.tokens, Path(tmp), a.oracle_placement)
                        if a.balanced else None)
        del model
        payload = {"sizes": sizes, "seed": a.seed, "attn": a.attn, "tmp": tmp, "ckpt": str(ckpt),
                   "profile_path": profile_path, "tokens": a.tokens,
                   "hp_chunks": a.hp_chunks, "compare_dedup": a.compare_dedup, "defer": a.defer, "only": a.only, "interleave": a.interleave, "fresh_threads": a.fresh_threads, "warmup": a.warmup, "iters": a.iters, "threads": a.threads,
                   "memory_rounds": a.memory_rounds, "trim_every_step": a.trim_every_step,
                   "profile": a.profile, "profile_rows": a.profile_rows, "profile_steps": a.profile_steps}
        try:
            ranks = run_world(WORLD, "tools.bench_e2e:worker", payload, timeout=a.timeout)
        except WorldError as e:
            raise SystemExit(f"the benchmark world failed:\n{e}") from e
    wall = time.perf_counter() - t0

    results = summarize(ranks)
    print_table(results, a, a.threads)
    for name, err in ranks[0]["errors"].items():
        print(f"\n{name} could not run:\n{err}")
    for name, r in results.items():
        if name != REFERENCE:
            probe = r["replicated_probe"]
            probes = None if probe is None else f"{probe['name']} (replicated, summed over ranks): {probe['max_rel']:.1e}"
            if r["grads_max_rel"] is None:  # a partial (one-batch) gradient: not comparable
                print(f"{name}: logits {r['logits_max_rel']:.2e}; grads not compared")
            else:
                print(f"{name}: logits {r['logits_max_rel']:.2e}; grads {r['grads_max_rel']:.2e} "
                      f"(worst {sorted(set(r['grads_worst']))}, expert weights "
                      f"{r['grads_max_rel_experts']:.2e}; {probes or '-'})")
            if name.startswith(HP) and "time_per_token_vs_native_excl_grad_sync" in r:
                print(f"{name}: without its gradient all-reduce {r['median_step_excl_grad_sync_s']:.3f} s, "
                      f"{r['time_per_token_vs_native_excl_grad_sync']:.2f}x native EP")
    load, load_balanced = ranks[0]["ep_load"], ranks[0]["ep_load_balanced"]
    for what, rows_by_layer in (("", load), (" with the balanced placement", load_balanced)):
        if rows_by_layer:
            print(f"rows per EP rank's experts (both ranks' tokens){what}, per MoE layer: " + ", ".join(
                f"{n.split('.mlp')[0].split('.')[-1]}: {rows} ({max(rows) / (sum(rows) / len(rows)):.2f}x mean)"
                for n, rows in rows_by_layer.items()))
    if a.profile:
        for name, prof in ranks[0]["profile"].items():
            print(f"\nprofile rank 0: {name} (self CPU time per step, mean of {prof['steps']} profiled steps, "
                  f"interleaved)\n{profile_text(prof)}")

    report = {
        "command": shlex.join(["python", *sys.argv]),
        "sizes": sizes, "config": model_config(sizes).to_dict(), "dtype": "float32", "device": "cpu",
        "backend": "gloo", "world": WORLD, "ep_size": EP_SIZE, "attn": a.attn, "iters": a.iters,
        "calibration_seqs": a.calibration_seqs if a.balanced else None, "tokens": a.tokens,
        "oracle_placement": a.oracle_placement,
        "warmup": a.warmup, "memory_rounds": a.memory_rounds, "trim_every_step": a.trim_every_step,
        "seed": a.seed, "threads_per_rank": a.threads,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "accelerate": accelerate.__version__},
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "cpu_count": os.cpu_count(), "load_average_1_5_15min": os.getloadavg(), "wall_s": wall,
        "reference": REFERENCE, "memory_method": ranks[0]["memory_method"], "results": results,
        "variant_info": ranks[0]["info"], "errors": ranks[0]["errors"], "ep_rows_per_rank_per_layer": load,
        "ep_rows_per_rank_per_layer_balanced": load_balanced,
        "ranks": [{k: r[k] for k in ("rank", "times", "memory", "agreement", "base_rss_mb", "process_maxrss_mb")}
                  for r in ranks],
    }
    if a.profile:
        report["profile"] = {f"rank{r['rank']}": r["profile"] for r in ranks}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

