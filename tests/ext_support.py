"""A small model whose MoE block no built-in archetype fits, for tests/test_extensions.py.

``TemperatureMoeBlock`` routes with a softmax over the top-k router logits divided by a temperature
(not the softmax over all experts the built-in ``softmax_topk`` inlines), and its experts holder takes
batched ``[B, S, H]`` rows (the transformers experts contract takes ``[T, H]``), so neither the
block-level nor the experts-level built-in archetype reproduces it. ``tests/ext_temperature.py`` is
the extension that rewrites it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from hp_rewrite.plan import parse_plan
from hp_rewrite.rewrite import generate, install
from hp_rewrite.runtime.group.groups import ExpertParallelGroup, build_expert_parallel_group
from hp_rewrite.verify import gradient_errors

VOCAB, HIDDEN, EXPERTS, WIDTH, TOP_K, LAYERS = 32, 16, 4, 8, 2, 2


class ExtDemoConfig(PretrainedConfig):
    model_type = "hp_ext_demo"


class TemperatureExperts(nn.Module):
    """Fused gate/up experts (transformers layout); forward takes ``[B, S, H]`` and ``[B, S, K]``."""

    def __init__(self, num_experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * width, hidden) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, width) * 0.2)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        index = top_k_index.reshape(hidden.shape[0], -1)
        weights = top_k_weights.reshape(hidden.shape[0], -1)
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            rows, slot = torch.where(index == e)
            gate, up = nn.functional.linear(hidden[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out.reshape(shape)


class TemperatureMoeBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, width: int, top_k: int, temperature: float) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = TemperatureExperts(num_experts, hidden, width)
        self.top_k, self.temperature = top_k, temperature

    def forward(self, hidden_states):
        top, index = self.gate(hidden_states).topk(self.top_k, dim=-1)
        weights = torch.softmax(top / self.temperature, dim=-1)
        return self.experts(hidden_states, index, weights)


class ExtDemoModel(nn.Module):
    def __init__(self, config: ExtDemoConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(LAYERS))
        self.layers = nn.ModuleList(
            TemperatureMoeBlock(HIDDEN, EXPERTS, WIDTH, TOP_K, temperature=0.7) for _ in range(LAYERS)
        )
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for norm, block in zip(self.norms, self.layers, strict=True):
            x = x + block(norm(x))
        return self.head(x)


def build_model(seed: int = 0) -> ExtDemoModel:
    torch.manual_seed(seed)
    return ExtDemoModel(ExtDemoConfig()).float()


def plan_for(ep_size: int, extensions: list[str] | None = None):
    text = f"version: 1\nep_size: {ep_size}\n"
    if extensions:
        text += "extensions: [" + ", ".join(extensions) + "]\n"
    return parse_plan(text)


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if b is None:
        return 0.0 if a is None else a.abs().max().item()
    a = torch.zeros_like(b) if a is None else a
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def compare(out_dir: str, rank: int = 0, world: int = 1) -> dict:
    """Rewrite through the extension at EP=world, and compare logits and every gradient with the
    unmodified model (each rank takes its share of the batch)."""
    plan = plan_for(world, ["tests.ext_temperature"])
    ep = build_expert_parallel_group(world) if world > 1 else ExpertParallelGroup.single()
    ref = build_model()
    model = copy.deepcopy(ref)
    analysis, artifact = generate(model, plan, model.config, Path(out_dir))
    patched = install(model, artifact, plan, ep)
    gen = torch.Generator().manual_seed(3)
    per_rank = 2
    ids = torch.randint(0, VOCAB, (per_rank * world, 6), generator=gen)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    ref_out, out = ref(ids), model(ids[mine])
    upstream = torch.randn(ref_out.shape, generator=gen)
    (ref_out * upstream).sum().backward()
    (out * upstream[mine]).sum().backward()
    errors = {"logits": _rel(out.detach(), ref_out.detach()[mine])}
    for name, (_, rel) in gradient_errors(model, ref, ep, world).items():
        errors[f"grad/{name}"] = rel
    return {
        "patched": patched,
        "archetypes": [r.archetype.as_dict() for r in analysis.matched],
        "unmatched": [r.reason for r in analysis.unmatched],
        "errors": errors,
        "artifact": str(artifact.directory),
        "local_experts": [int(b.experts.gate_up_proj.shape[0]) for b in model.layers],
    }


def run_world_case(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    return compare(payload["out_dir"], rank, world)
