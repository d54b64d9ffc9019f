"""Remote-code MoE models of our own, written into checkpoints loaded with ``trust_remote_code=True``.

:func:`write_checkpoint` saves a tiny random model with ``save_pretrained`` and copies the modeling files
beside it with the ``auto_map`` the Hub's remote-code repos carry, so transformers imports the classes
from the checkpoint directory, not from this package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FILES = ("configuration_tiny_moe.py", "modeling_tiny_moe.py")
AUTO_MAP = {
    "AutoConfig": "configuration_tiny_moe.TinyMoeConfig",
    "AutoModel": "modeling_tiny_moe.TinyMoeModel",
    "AutoModelForCausalLM": "modeling_tiny_moe.TinyMoeForCausalLM",
}


def write_checkpoint(out: Path, router: str = "softmax", seed: int = 0, **config) -> Path:
    """A tiny remote-code MoE checkpoint in ``out`` (``router``: see ``TinyMoeConfig``)."""
    from .modeling_tiny_moe import TinyMoeConfig, TinyMoeForCausalLM

    torch.manual_seed(seed)
    model = TinyMoeForCausalLM(TinyMoeConfig(router=router, **config))
    if router == "sigmoid_group":  # a bias that changes the selection, as trained checkpoints have
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.normal_(0, 0.5)
    out = Path(out)
    model.save_pretrained(out)
    for f in FILES:
        shutil.copy(HERE / f, out / f)
    cfg = json.loads((out / "config.json").read_text())
    cfg["auto_map"] = AUTO_MAP
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
