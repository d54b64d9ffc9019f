"""Save an expert-parallel model, reload it (each rank in a real gloo world)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hp_rewrite import auto_patch
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime import installed


def load_and_save(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    plan = parse_plan(payload.get("plan") or f"version: 1\nep_size: {payload['ep_size']}\n")
    with auto_patch(plan, artifact_dir=Path(payload["gen_dir"])):
        model = AutoModelForCausalLM.from_pretrained(payload["model_dir"], attn_implementation="eager")
    placements = [installed.binding(m).placement for m in model.modules()
                  if installed.binding(m) is not None]
    local = [p.num_local for p in placements]
    model.save_pretrained(payload["out_dir"])  # collective: every rank, rank 0 writes
    return {"local": local, "local_experts": [list(p.local_experts) for p in placements]}


def load_and_compare(rank: int, world: int, payload: dict) -> dict:
    """Load ``model_dir`` at EP=world and compare logits of this rank's batch with the plain model."""
    torch.set_num_threads(1)
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    plain = AutoModelForCausalLM.from_pretrained(payload["reference_dir"], attn_implementation="eager")
    with auto_patch(plan, artifact_dir=Path(payload["gen_dir"])):
        model = AutoModelForCausalLM.from_pretrained(payload["model_dir"], attn_implementation="eager")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, plain(input_ids=ids).logits
    return {"rel": ((a - b).abs().max() / b.abs().max()).item()}


def written_files(directory: Path) -> dict[str, object]:
    """Every file save_pretrained wrote: JSON documents parsed, safetensors as (metadata, tensors)."""
    import json

    from safetensors import safe_open

    out: dict[str, object] = {}
    for f in sorted(directory.iterdir()):
        if f.suffix == ".safetensors":
            with safe_open(f, framework="pt") as h:
                out[f.name] = (h.metadata(), {k: h.get_tensor(k) for k in h.keys()})
        else:
            out[f.name] = json.loads(f.read_text()) if f.suffix == ".json" else f.read_text()
    return out


def assert_same_files(ours: Path, theirs: Path) -> None:
    a, b = written_files(ours), written_files(theirs)
    assert a.keys() == b.keys()
    for name, value in b.items():
        if isinstance(value, tuple):
            assert a[name][0] == value[0] and a[name][1].keys() == value[1].keys(), name
            for k, t in value[1].items():
                assert a[name][1][k].dtype == t.dtype and torch.equal(a[name][1][k], t), (name, k)
        else:
            assert a[name] == value, name
