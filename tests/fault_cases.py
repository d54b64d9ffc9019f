"""A rank that raises or dies in the middle of a forward must not leave the others hanging."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.tiny import build_tiny_model, tiny_config


def faulty_training(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    plan = parse_plan(f"version: 1\nep_size: {world}\nruntime:\n  timeout_s: {payload['timeout_s']}\n")
    model = rewrite_model(build_tiny_model(tiny_config("qwen3_moe"), seed=0), plan,
                          artifact_dir=Path(payload["out_dir"]))
    layer = model.model.layers[1].mlp

    def fail(*_):
        if payload["mode"] == "die":
            os._exit(3)
        raise RuntimeError("injected failure in the second MoE layer")

    for step in range(3):
        if rank == 1 and step == 1:
            layer.register_forward_pre_hook(fail)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
    return {"steps": 3}
