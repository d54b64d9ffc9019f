"""The library behind ``hp-rewrite apply``: find or generate the artifact, then run it on local ranks.

:func:`generate_artifact` reuses a current artifact from its key and recorded summary (no model
built, no probe run) or analyses the model built on the meta device and writes a new one.
:func:`run_on_ranks` loads the checkpoint on ``nproc`` local gloo ranks with the generated forwards
and, with ``verify``, compares every logit and gradient with the unmodified model. Mistakes the user
can fix raise :mod:`hp_rewrite.errors`; the CLI renders the results.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import OutputError, UserError
from .hf import meta_model, top_k_of

DEFAULT_OUT = Path("hp-rewrite-out")


@dataclass
class Generated:
    """The artifact for a plan and a model, and what the analysis found (rows as the report stores them)."""

    artifact: object  # hp_rewrite.codegen.Artifact
    modules: list[dict]
    unmatched: list[dict]
    excluded: list[str]
    cached: bool


@dataclass
class RankRun:
    """What the local ranks reported; ``failure`` is the launcher's message when the world failed."""

    ranks: list[dict]
    run_s: float
    failure: str | None = None
    verify: dict | None = None
    timings: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.failure is None and (self.verify is None or self.verify["passed"])


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON through a temporary file in the same directory, so no half file remains."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def output_dir(plan, out: Path | None) -> Path:
    """``--out``, else the plan's ``output.dir``, else ./hp-rewrite-out; refused when it is a file."""
    out_dir = Path(out or plan.output.dir or DEFAULT_OUT)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"--out {out_dir} is a file: give a directory (it is created if missing)")
    return out_dir


def check_world(plan, nproc: int | None) -> None:
    if nproc is not None and (nproc < 1 or nproc % plan.ep_size):
        raise UserError(f"--nproc {nproc} is not a multiple of the plan's ep_size {plan.ep_size}: "
                        "the world is split into EP groups of ep_size ranks")
    if nproc is not None and nproc % plan.tp_size:
        raise UserError(f"--nproc {nproc} is not a multiple of the plan's tp_size {plan.tp_size}: "
                        "the world is split into TP groups of tp_size ranks")
    if nproc is not None and nproc % plan.cp_size:
        raise UserError(f"--nproc {nproc} is not a multiple of the plan's cp_size {plan.cp_size}: "
                        "the world is split into context groups of cp_size ranks")


def check_tensor_parallel(plan, config) -> None:
    """With ``tp_size > 1``: the TP layout of the model (on the meta device), refused here with the
    reason rather than on every rank."""
    if plan.tp_size == 1:
        return
    from .loading.patch import tensor_layout

    tensor_layout(meta_model(config), plan, lambda s: plan.matches(s.path, type(s.block).__name__))


def check_context(plan, config) -> None:
    """With ``cp_size > 1``: Ulysses gives each context rank heads / cp_size attention heads, refused here
    rather than on every rank when cp_size does not divide them."""
    heads = getattr(config.get_text_config(), "num_attention_heads", None)
    if plan.cp_size > 1 and isinstance(heads, int) and heads % plan.cp_size:
        raise UserError(f"cp_size {plan.cp_size} does not divide the model's {heads} attention heads (Ulysses "
                        "gives each context rank heads / cp_size of them): choose a cp_size that divides it")


def _experts_by_rank(plan, s) -> list[list[int]] | None:
    """Each EP rank's experts under the plan's placement (None when the placement is contiguous)."""
    from .match.analysis import expert_placement
    from .runtime.group.groups import ExpertParallelGroup

    if plan.placement.strategy == "contiguous" or s.num_experts % plan.ep_size:
        return None
    placement = expert_placement(plan, s, ExpertParallelGroup(size=plan.ep_size))
    return None if placement.is_contiguous else [list(placement.experts_of(r)) for r in range(plan.ep_size)]


def module_rows(analysis, plan) -> tuple[list[dict], list[dict]]:
    """One row per matched block and per unmatched one, as the report and the cached summary keep them."""
    ep_size = plan.ep_size
    modules = []
    for r in analysis.matched:
        s = r.structure
        modules.append({
            "path": s.path,
            "class": type(s.block).__name__,
            "experts_class": type(s.experts).__name__,
            "archetype": r.archetype.as_dict(),
            "num_experts": s.num_experts,
            "local_experts": s.num_experts // ep_size if s.num_experts % ep_size == 0 else None,
            "top_k": top_k_of(s.block, s.block.get_submodule(s.router_name) if s.router_name else None),
            "experts_by_rank": _experts_by_rank(plan, s),
        })
    unmatched = [{"path": r.structure.path, "class": type(r.structure.block).__name__, "reason": r.reason}
                 for r in analysis.unmatched]
    return modules, unmatched


def generate_artifact(plan, config, model_dir: Path, out_dir: Path) -> Generated:
    """The current artifact for (plan, config) under ``out_dir``: reused when its key matches, else written."""
    from .codegen.artifacts import find_current

    cached = find_current(out_dir, plan.hash(), config) if out_dir.is_dir() else None
    summary = cached.summary if cached is not None else None
    if summary is not None:  # current for these inputs: no model built, no probe run
        return Generated(cached, summary["modules"], summary["unmatched"], summary["excluded"], cached=True)
    return _generate(plan, config, model_dir, out_dir)


def _generate(plan, config, model_dir: Path, out_dir: Path) -> Generated:
    from .match.analysis import analyze
    from .match.diagnosis import nothing_to_rewrite
    from .match.generate import write

    model = meta_model(config)
    analysis = analyze(model, plan)
    if not analysis.matched:  # a dense model, globs selecting no block, or no block matched
        raise nothing_to_rewrite(model, plan, config, analysis, source=model_dir)
    modules, unmatched = module_rows(analysis, plan)
    bad = [m for m in modules if m["local_experts"] is None]
    if bad:
        raise UserError(f"ep_size {plan.ep_size} does not divide the {bad[0]['num_experts']} experts of "
                        f"{bad[0]['path']}: choose an ep_size that divides it")
    artifact = write(analysis, plan, config, out_dir)
    artifact.record_summary({"modules": modules, "unmatched": unmatched, "excluded": analysis.excluded})
    return Generated(artifact, modules, unmatched, analysis.excluded, cached=False)


def run_on_ranks(plan, model_dir: Path, out_dir: Path, nproc: int, verify: bool,
                 timeout: float | None, trust_remote_code: bool = False) -> RankRun:
    """Run the rewritten model on ``nproc`` local gloo ranks (``hp_rewrite.verify``), checked with ``verify``."""
    from .launch import WorldError, run_world

    payload = {"plan": plan.canonical(), "artifact_root": str(out_dir),
               "model_dir": str(model_dir), "verify": verify, "batch_per_rank": 2, "seq_len": 16,
               "trust_remote_code": trust_remote_code}
    t0 = time.perf_counter()
    try:
        ranks = run_world(nproc, "hp_rewrite.verify:run_rank", payload,
                          timeout=timeout or max(120.0, (plan.runtime.timeout_s or 0) * 4))
    except WorldError as e:
        if e.user_error is not None:  # the checkpoint or the options, not the run: a clean error
            raise UserError(e.user_error) from None
        return RankRun([], time.perf_counter() - t0, failure=str(e))
    run = RankRun(ranks, time.perf_counter() - t0)
    if verify and ranks:
        run.verify = summarize_verify(ranks)
    return run


def summarize_verify(ranks: list[dict]) -> dict:
    """The worst errors over the ranks, the tolerance, and whether every rank passed."""
    v = [r["verify"] for r in ranks]
    return {
        "logits_max_abs": max(x["logits_max_abs"] for x in v),
        "logits_max_rel": max(x["logits_max_rel"] for x in v),
        "grad_max_abs": max(x["grad_max_abs"] for x in v),
        "grad_max_rel": max(x["grad_max_rel"] for x in v),
        "tolerance": v[0]["tolerance"],
        "passed": all(x["passed"] for x in v),
    }
