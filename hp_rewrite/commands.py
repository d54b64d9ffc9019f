"""Implementations of the ``hp-rewrite`` subcommands (the argument parsing lives in cli.py).

Each returns a process exit code. User errors raise :class:`UserError`; the CLI prints its message
(no traceback) and exits 2.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 160)


class UserError(Exception):
    """A mistake the user can fix (bad plan, bad model directory, wrong sizes...)."""


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def load_config(model_dir: Path):
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise UserError(f"{model_dir}: no config.json; pass a transformers checkpoint directory "
                        "(hp-rewrite make-tiny MODEL_TYPE DIR writes a small one)")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise UserError(f"{model_dir}/config.json: transformers cannot read it: {e}") from e


def meta_model(config):
    """The model built on the meta device: structure only, no weights read or allocated."""
    import torch

    from .loading.tiny import auto_class_for

    with torch.device("meta"):
        return auto_class_for(config).from_config(config, attn_implementation="eager")


def _top_k(s) -> int | None:
    router = getattr(s.block, s.router_name) if s.router_name else None
    for owner in (router, s.block):
        k = getattr(owner, "top_k", None)
        if isinstance(k, int):
            return k
    return None


def _experts_by_rank(plan, s) -> list[list[int]] | None:
    """Each EP rank's experts under the plan's placement (None when the placement is contiguous)."""
    from .rewrite import expert_placement
    from .runtime import ExpertParallelGroup

    if plan.placement.strategy == "contiguous" or s.num_experts % plan.ep_size:
        return None
    placement = expert_placement(plan, s, ExpertParallelGroup(size=plan.ep_size))
    return None if placement.is_contiguous else [list(placement.experts_of(r)) for r in range(plan.ep_size)]


def module_rows(analysis, plan) -> tuple[list[dict], list[dict]]:
    ep_size = plan.ep_size
    modules = [
        {
            "path": r.structure.path,
            "class": type(r.structure.block).__name__,
            "experts_class": type(r.structure.experts).__name__,
            "archetype": r.archetype.as_dict(),
            "num_experts": r.structure.num_experts,
            "local_experts": r.structure.num_experts // ep_size if r.structure.num_experts % ep_size == 0 else None,
            "top_k": _top_k(r.structure),
            "experts_by_rank": _experts_by_rank(plan, r.structure),
        }
        for r in analysis.matched
    ]
    unmatched = [{"path": r.structure.path, "class": type(r.structure.block).__name__, "reason": r.reason}
                 for r in analysis.unmatched]
    return modules, unmatched


def apply(plan_path: Path, model_dir: Path, out: Path | None, nproc: int | None, verify: bool,
          report: Path | None, timeout: float | None) -> int:
    from .codegen.artifacts import find_current
    from .plan import load_plan

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    plan = load_plan(plan_path)
    config = load_config(model_dir)
    out_dir = Path(out or plan.output.dir or "hp-rewrite-out")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file: give a directory (it is created if missing)")
    if nproc is not None and (nproc < 1 or nproc % plan.ep_size):
        raise UserError(f"--nproc {nproc} is not a multiple of the plan's ep_size {plan.ep_size}: "
                        "the world is split into EP groups of ep_size ranks")
    cached = find_current(out_dir, plan.hash(), config) if out_dir.is_dir() else None
    summary = cached.summary if cached is not None else None
    if summary is not None:  # current for these inputs: no model built, no probe run
        artifact, modules, unmatched = cached, summary["modules"], summary["unmatched"]
        timings["generate_s"] = time.perf_counter() - t0
        _print_modules(modules, unmatched, summary["excluded"], artifact, cached=True)
    else:
        artifact, modules, unmatched = _generate(plan, config, out_dir, model_dir)
        timings["generate_s"] = time.perf_counter() - t0
    return _run_generated(plan, model_dir, out_dir, artifact, modules, unmatched, nproc, verify, report, timeout,
                          timings)


def _generate(plan, config, out_dir: Path, model_dir: Path):
    """Analyse the model built on the meta device and write (or reuse) the artifact."""
    from .rewrite import analyze, write

    model = meta_model(config)
    analysis = analyze(model, plan)
    if not (analysis.matched or analysis.unmatched or analysis.excluded):
        raise UserError(
            f"{model_dir}: no MoE block in this {config.model_type} model, nothing to rewrite "
            f"(`hp-rewrite describe-moe {model_dir}` shows what hp-rewrite looks for)"
        )
    if not (analysis.matched or analysis.unmatched):
        shown = ", ".join(analysis.excluded[:3]) + (", ..." if len(analysis.excluded) > 3 else "")
        raise UserError(
            f"modules.include {plan.modules.include} / exclude {plan.modules.exclude} select none of the "
            f"{len(analysis.excluded)} MoE blocks ({shown}): match their paths or class names"
        )
    modules, unmatched = module_rows(analysis, plan)
    bad = [m for m in modules if m["local_experts"] is None]
    if bad:
        raise UserError(f"ep_size {plan.ep_size} does not divide the {bad[0]['num_experts']} experts of "
                        f"{bad[0]['path']}: choose an ep_size that divides it")
    artifact = write(analysis, plan, config, out_dir)
    artifact.record_summary({"modules": modules, "unmatched": unmatched, "excluded": analysis.excluded})
    _print_modules(modules, unmatched, analysis.excluded, artifact)
    return artifact, modules, unmatched


def _run_generated(plan, model_dir: Path, out_dir: Path, artifact, modules, unmatched, nproc, verify, report,
                   timeout, timings) -> int:
    from .launch import WorldError, run_world

    result = {"modules": modules, "unmatched": unmatched, "generated": artifact.files, "timings": timings}
    code = 0
    if nproc:
        payload = {"plan": plan.canonical(), "artifact_root": str(out_dir),
                   "model_dir": str(model_dir), "verify": verify, "batch_per_rank": 2, "seq_len": 16}
        t0 = time.perf_counter()
        try:
            ranks = run_world(nproc, "hp_rewrite.verify:run_rank", payload,
                              timeout=timeout or max(120.0, plan.runtime.timeout_s * 4))
        except WorldError as e:
            console.print(f"[red]error:[/] the expert-parallel run failed:\n{e}")
            ranks, code = [], 1
        timings["run_s"] = time.perf_counter() - t0
        result["ranks"] = ranks
        if verify and ranks:
            result["verify"] = _summarize_verify(ranks)
            _print_verify(ranks)
            code = 0 if result["verify"]["passed"] else 1
    if report:
        _write_json_atomic(report, result)
    return code


def _summarize_verify(ranks: list[dict]) -> dict:
    v = [r["verify"] for r in ranks]
    return {
        "logits_max_abs": max(x["logits_max_abs"] for x in v),
        "logits_max_rel": max(x["logits_max_rel"] for x in v),
        "grad_max_abs": max(x["grad_max_abs"] for x in v),
        "grad_max_rel": max(x["grad_max_rel"] for x in v),
        "tolerance": v[0]["tolerance"],
        "passed": all(x["passed"] for x in v),
    }


def _grouped(modules: list[dict]) -> list[tuple[str, dict]]:
    """Consecutive blocks that differ only in their layer index, as one row: ``model.layers.{3..58}.mlp``."""
    import re

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


def _print_modules(modules, unmatched, excluded, artifact, cached: bool = False) -> None:
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


def _print_verify(ranks: list[dict]) -> None:
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


def find_artifact(directory: Path) -> Path:
    from .codegen.artifacts import MANIFEST_FILE

    if (directory / MANIFEST_FILE).is_file():
        return directory
    found = sorted((p.parent for p in directory.glob(f"*/{MANIFEST_FILE}")), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UserError(f"{directory}: no generated artifact here; run hp-rewrite apply first")
    return found[-1]


def inspect_artifact(directory: Path, block: str | None, diff: bool) -> int:
    from rich.syntax import Syntax

    from .codegen.artifacts import DIFF_FILE, MANIFEST_FILE, MODULE_FILE

    art = find_artifact(directory)
    manifest = json.loads((art / MANIFEST_FILE).read_text())
    if diff:
        text, lexer = (art / DIFF_FILE).read_text(), "diff"
    else:
        text, lexer = (art / MODULE_FILE).read_text(), "python"
    if block:
        names = {q.rsplit(".", 1)[-1]: e["function"] for q, e in manifest["classes"].items()}
        if block not in names:
            raise UserError(f"--block {block}: no generated forward for it; generated classes: {', '.join(sorted(names))}")
        text = _section(text, names[block], diff)
    console.print(Syntax(text, lexer, line_numbers=not diff, word_wrap=False))
    return 0


def _section(text: str, function: str, diff: bool) -> str:
    if diff:
        parts = text.split("--- a/")
        return "".join("--- a/" + p for p in parts if f":{function}\n" in p)
    lines, keep, out = text.splitlines(keepends=True), False, []
    for line in lines:
        if line.startswith("def "):
            keep = line.startswith(f"def {function}(")
        if keep:
            out.append(line)
    return "".join(out)


def make_tiny_checkpoint(model_type: str | None, out_dir: Path, from_config: Path | None, seed: int) -> int:
    from .loading.tiny import TinyError, make_tiny

    if (model_type is None) == (from_config is None):
        raise UserError("give a MODEL_TYPE or --from-config DIR (exactly one)")
    if from_config is not None and not (from_config / "config.json").is_file():
        raise UserError(f"--from-config {from_config}: no config.json there")
    try:
        path = make_tiny(model_type, out_dir, from_config=from_config, seed=seed)
    except TinyError as e:
        raise UserError(str(e)) from e
    console.print(f"wrote a tiny random-weight checkpoint to {path}")
    return 0
