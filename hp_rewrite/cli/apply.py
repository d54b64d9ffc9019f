"""``hp-rewrite apply PLAN MODEL_DIR``: generate (or reuse) the artifact, optionally run and verify it."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from .common import console, typed


@dataclass(frozen=True)
class ApplyArgs:
    plan: Path
    model_dir: Path
    out: Path | None
    nproc: int | None
    verify: bool
    report: Path | None
    timeout: float | None
    trust_remote_code: bool = False


def register(sub) -> None:
    ap = sub.add_parser("apply", help="match the MoE blocks of a checkpoint, generate expert-parallel forwards, "
                        "optionally run and verify them on local ranks")
    ap.add_argument("plan", type=Path, help="YAML parallel plan (see plans/)")
    ap.add_argument("model_dir", type=Path, help="transformers checkpoint directory (config.json + weights)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where generated code goes (default: the plan's output.dir, else ./hp-rewrite-out)")
    ap.add_argument("--nproc", type=int, default=None, help="run the rewritten model on N local ranks (gloo)")
    ap.add_argument("--verify", action="store_true", help="with --nproc: compare logits and every gradient with "
                    "the unmodified model; exit 1 beyond tolerance")
    ap.add_argument("--report", type=Path, default=None, help="write a JSON report here")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before a hung run is stopped")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run the checkpoint's own modeling code (its config.json auto_map), as transformers' "
                    "trust_remote_code=True; read that code first")
    ap.set_defaults(run=lambda ns: apply(typed(ApplyArgs, ns)))


def apply(args: ApplyArgs) -> int:
    from ..apply import (
        check_context,
        check_tensor_parallel,
        check_world,
        generate_artifact,
        output_dir,
        run_on_ranks,
        write_json_atomic,
    )
    from ..hf import load_config
    from ..loading.quantized import load_note
    from ..plan import load_plan

    t0 = time.perf_counter()
    plan = load_plan(args.plan)
    config = load_config(args.model_dir, args.trust_remote_code)
    checkpoint = load_note(config, str(args.model_dir))  # a quantisation the loaders cannot read: refused here
    out_dir = output_dir(plan, args.out)
    check_world(plan, args.nproc)
    check_tensor_parallel(plan, config)
    check_context(plan, config)
    gen = generate_artifact(plan, config, args.model_dir, out_dir)
    timings = {"generate_s": time.perf_counter() - t0}
    print_modules(gen.modules, gen.unmatched, gen.excluded, gen.artifact, cached=gen.cached)
    if checkpoint:
        console.print(f"checkpoint: {checkpoint}", highlight=False)
    result = {"modules": gen.modules, "unmatched": gen.unmatched, "generated": gen.artifact.files,
              "timings": timings, "checkpoint": checkpoint}
    code = 0
    if args.nproc:
        run = run_on_ranks(plan, args.model_dir, out_dir, args.nproc, args.verify, args.timeout,
                           args.trust_remote_code)
        timings["run_s"] = run.run_s
        result["ranks"] = run.ranks
        print_kernels(run.ranks)
        if run.failure is not None:
            console.print(f"[red]error:[/] the expert-parallel run failed:\n{run.failure}")
            code = 1
        if run.verify is not None:
            result["verify"] = run.verify
            print_verify(run.ranks)
            code = 0 if run.verify["passed"] else 1
    if args.report:
        write_json_atomic(args.report, result)
    return code


def _grouped(modules: list[dict]) -> list[tuple[str, dict]]:
    """Consecutive blocks that differ only in their layer index, as one row: ``model.layers.{3..58}.mlp``."""
    rows: list[tuple[str, list[int], dict]] = []  # (path pattern, layer indices, row)
    for m in modules:
        match = re.search(r"\.(\d+)\.", m["path"])
        same = {k: v for k, v in m.items() if k not in ("path", "experts_by_rank")}
        if match and not m["experts_by_rank"]:
            pattern = m["path"][: match.start(1)] + "{}" + m["path"][match.end(1):]
            last = rows[-1] if rows else None
            if last and last[0] == pattern and last[1] and last[1][-1] + 1 == int(match.group(1)) and last[2] == same:
                last[1].append(int(match.group(1)))
                continue
            rows.append((pattern, [int(match.group(1))], same))
        else:
            rows.append((m["path"], [], same))
    out = []
    for pattern, layers, row in rows:
        if len(layers) > 1:
            path = pattern.format("{" + f"{layers[0]}..{layers[-1]}" + "}") + f" ({len(layers)} blocks)"
        else:
            path = pattern.format(layers[0]) if layers else pattern
        out.append((path, row))
    return out


def print_modules(modules, unmatched, excluded, artifact, cached: bool = False) -> None:
    from rich.table import Table

    table = Table(title=f"MoE blocks ({len(modules)} matched, {len(unmatched)} unmatched)")
    for col in ("module", "class", "level", "router", "shared", "layout", "experts", "local", "top-k"):
        table.add_column(col)
    for paths, m in _grouped(modules):
        a = m["archetype"]
        table.add_row(paths, m["class"], a["level"], a["router"], a["shared"], a["layout"],
                      str(m["num_experts"]), str(m["local_experts"]), str(m["top_k"]))
    console.print(table)
    for m in modules:
        if m["experts_by_rank"]:
            ranks = "; ".join(f"rank {r}: {e}" for r, e in enumerate(m["experts_by_rank"]))
            console.print(f"placement of {m['path']} (balanced): {ranks}", highlight=False)
    for u in unmatched:
        console.print(f"[yellow]unmatched[/] {u['path']} ({u['class']}): {u['reason']}")
    if excluded:
        console.print(f"excluded by the plan: {len(excluded)} block(s)")
    console.print(f"{'current, reused' if cached else 'generated'}: {artifact.directory}")


def print_kernels(ranks: list[dict]) -> None:
    """Which expert-compute backend each rank ran, and why (``runtime.compute`` and transformers'
    ``experts_implementation``; hp_rewrite.kernels)."""
    seen = set()
    for rank, r in enumerate(ranks):
        for k in r.get("kernels", []):
            key = (k["backend"], k["reason"])
            if key not in seen:
                seen.add(key)
                console.print(f"expert compute (rank {rank}, {len(k['holders'])} block(s), experts_implementation "
                              f"{k.get('experts_implementation')}): [bold]{k['backend']}[/] - {k['reason']}",
                              highlight=False)
        p = r.get("permutations")
        if p and (p["backend"], p["reason"]) not in seen:
            seen.add((p["backend"], p["reason"]))
            console.print(f"row permutations (rank {rank}): [bold]{p['backend']}[/] - {p['reason']}", highlight=False)
    tp = ranks[0].get("tensor_parallel") if ranks else None
    if tp:
        console.print(f"tensor parallel: tp_size {tp['tp_size']}, {tp['split_modules']} dense modules split"
                      + (", sequence parallel" if tp["sequence_parallel"] else ""), highlight=False)
    cp = ranks[0].get("context_parallel") if ranks else None
    if cp:
        console.print(f"context parallel ({cp['scheme']}): cp_size {cp['cp_size']}, each sequence split after the "
                      f"embeddings, {cp['attention_modules']} attention modules exchanging heads", highlight=False)


def print_verify(ranks: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="expert-parallel vs unmodified model (fp32)")
    for col in ("rank", "logits max rel", "grad max rel", "worst grad", "EP step s", "reference step s"):
        table.add_column(col)
    for rank, r in enumerate(ranks):
        v = r["verify"]
        table.add_row(str(rank), f"{v['logits_max_rel']:.2e}", f"{v['grad_max_rel']:.2e}", v["worst_grad"],
                      f"{r['timings']['ep_step_s']:.2f}", f"{r['timings']['reference_step_s']:.2f}")
    console.print(table)
    ok = all(r["verify"]["passed"] for r in ranks)
    tol = ranks[0]["verify"]["tolerance"]
    console.print("[green]verify: PASS[/]" if ok else f"[red]verify: FAIL[/] (tolerance {tol:.0e})")
