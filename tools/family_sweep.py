"""Sweep every MoE model type of the installed transformers through the rewriter at EP=1.

For each type: build the tiny random-weight model, match + generate + install with an auto plan, and
compare the whole model's logits and every parameter gradient with the unmodified model (fp32).
Writes a Markdown table (family, block class, archetype, status) used by the README.

    python tools/family_sweep.py --out docs/families.md
"""

from __future__ import annotations

import argparse
import copy
import inspect
import tempfile
import time
from pathlib import Path

import torch

from hp_rewrite.match.misfits import find_misfits, group_misfits
from hp_rewrite.match.structure import find_experts_holders
from hp_rewrite.plan import DEFAULT_PLAN
from hp_rewrite.rewrite import generate, install
from hp_rewrite.runtime import ExpertParallelGroup
from hp_rewrite.tiny import build_tiny_model, survey_model_types, tiny_config
from hp_rewrite.verify import gradient_errors

TOL = 1e-5


def sample_inputs(model) -> dict:
    """Inputs for a tiny model, by its forward's signature: token ids; embeddings for a decoder with no
    embedding table of its own (a talker fed by another model); a 4x4 patch grid for a vision encoder
    taking ``(pixel_values, grid_thw)``."""
    params = inspect.signature(type(model).forward).parameters
    cfg, gen = model.config, torch.Generator().manual_seed(0)
    if "pixel_values" in params and "grid_thw" in params and "input_ids" not in params:
        width = cfg.num_channels * (getattr(cfg, "temporal_patch_size", 1) or 1) * cfg.patch_size**2
        return {"pixel_values": torch.randn(16, width, generator=gen), "grid_thw": torch.tensor([[1, 4, 4]])}
    ids = {"input_ids": torch.randint(0, cfg.get_text_config().vocab_size, (2, 8), generator=gen)}
    if "inputs_embeds" in params:
        try:
            with torch.no_grad():
                model(**ids)
        except Exception:  # noqa: BLE001 - e.g. a talker whose forward has no embedding table for ids
            return {"inputs_embeds": torch.randn(2, 8, cfg.get_text_config().hidden_size, generator=gen)}
    return ids


def runnable_part(model) -> str:
    """The module the sweep runs: the model, or for a container without a forward of its own (an omni
    model that only generates) its first child model that takes ``input_ids`` (the thinker)."""
    if type(model).forward is not torch.nn.Module.forward:
        return ""
    for name, child in model.named_children():
        if type(child).forward is not torch.nn.Module.forward and "input_ids" in inspect.signature(child.forward).parameters:
            return name
    return ""


def check(model_type: str, out_dir: Path) -> dict:
    ref = build_tiny_model(tiny_config(model_type), seed=0)
    model = copy.deepcopy(ref)
    analysis, artifact = generate(model, DEFAULT_PLAN, model.config, out_dir)
    patched = install(model, artifact, DEFAULT_PLAN, ExpertParallelGroup.single())
    row = {
        "blocks": sorted({type(r.structure.block).__name__ for r in analysis.matched + analysis.unmatched}),
        "archetypes": sorted({"{level}/{router}/{shared}/{layout}".format(**r.archetype.as_dict())
                              for r in analysis.matched}),
        "unmatched": sorted({r.reason[:160] for r in analysis.unmatched}),
        "patched": len(patched),
    }
    if not patched:
        holders = [path for path, _ in find_experts_holders(model)]
        misfits = group_misfits(find_misfits(model, model.config, holders))
        first = {m.kind: m for m in reversed(misfits)}  # one finding per kind (encoder and decoder alike)
        row["unmatched"] = row["unmatched"] or [f"{k}: {m.reason}; what to do: {m.action}" for k, m in sorted(first.items())] or [
            "no experts holder follows the (hidden, top_k_index, top_k_weights) contract: left untouched; "
            "`hp-rewrite describe-moe` gives the reason and what to do"]
        return {**row, "status": "unmatched"}
    part = runnable_part(ref)
    inputs = sample_inputs(ref.get_submodule(part))
    outs = []
    for m in (ref.get_submodule(part), model.get_submodule(part)):  # the same random upstream gradient for both (a well-conditioned check)
        torch.manual_seed(0)  # models that sample inside forward (diffusion) draw the same noise
        out = m(**inputs)
        logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
        (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        outs.append(logits.detach())
    logit_err = ((outs[1] - outs[0]).abs().max() / outs[0].abs().max().clamp_min(1e-12)).item()
    grad_err = max((rel for _, rel in gradient_errors(model, ref, ExpertParallelGroup.single(), 1).values()), default=0.0)
    ok = logit_err <= TOL and grad_err <= TOL
    return {**row, "status": "pass" if ok else "FAIL", "logits_rel": logit_err, "grad_rel": grad_err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/families.md"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for survey in survey_model_types():
            if survey.status == "dense":
                continue
            if survey.status != "moe":
                rows.append((survey.model_type, {"status": "tiny build fails (transformers)", "blocks": [],
                                                 "archetypes": [], "unmatched": [survey.detail[:160]]}))
                continue
            t0 = time.perf_counter()
            try:
                row = check(survey.model_type, Path(tmp))
            except Exception as e:  # noqa: BLE001 - a sweep reports every failure and goes on
                row = {"status": f"error: {type(e).__name__}: {str(e)[:160]}", "blocks": [], "archetypes": [],
                       "unmatched": []}
            print(f"{survey.model_type:28s} {row['status']:10s} {time.perf_counter() - t0:5.1f}s {row['archetypes']}",
                  flush=True)
            rows.append((survey.model_type, row))
    lines = ["# MoE families through the rewriter (EP=1, tiny models, fp32)\n",
             "Generated by `python tools/family_sweep.py`: logits and every parameter gradient of the rewritten",
             "model compared with the unmodified model (tolerance 1e-5 relative). A model without a forward of",
             "its own (an omni model that only generates) runs its first child taking `input_ids`; a talker",
             "fed by another model's embeddings gets `inputs_embeds`; a vision encoder a 4x4 patch grid.\n",
             "Where transformers' default config lacks a field its modeling code reads (dbrx's",
             "`attn_config.rope_theta` and `clip_qkv`; the Qwen3-Omni talker's `shared_expert_intermediate_size`",
             "and `spatial_merge_size`), the tiny builder fills in the released checkpoints' value",
             "(`FAMILY_DEFAULTS` in `hp_rewrite/hf/shrink.py`); expert weights transformers leaves uninitialised",
             "(the Qwen3-Omni talker's) are drawn (`fill_uninitialised_experts`); `inkling_mm_model` needs",
             "scipy (in the `test` extra). Each family left untouched says why and what to do (the same text as",
             "`hp-rewrite describe-moe`).\n",
             "| family | block class | archetype (level/router/shared/layout) | status | note |",
             "|---|---|---|---|---|"]
    for model_type, row in rows:
        note = "; ".join(row.get("unmatched", []))
        lines.append(f"| {model_type} | {', '.join(row['blocks'])} | {'<br>'.join(row['archetypes'])} | "
                     f"{row['status']} | {note.replace('|', '/')} |")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
