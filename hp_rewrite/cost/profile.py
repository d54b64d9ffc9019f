"""Routing profile: tokens routed to each expert of each MoE layer, on real token ids.

The unmodified model is run in-process (the rewrite's routing is the same at any EP: same router
code, same top-k), with a forward pre-hook on every experts holder reading the ``top_k_index``
argument of the transformers experts contract ``(hidden, top_k_index, top_k_weights)``. The counts
are the routers' demand, before any capacity drop (the cost model applies the plan's capacity).
The histogram of a layer is what the cost model's skew-aware estimate takes
(:class:`~hp_rewrite.cost.routing.Histograms`), and grouping its experts by owner rank for a
given ``ep`` gives that layer's imbalance (busiest rank's load / mean load).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..hf import top_k_of
from ..match.structure import experts_layout, find_blocks
from ..runtime.routing.routing_load import layer_index
from .routing import RankLoads, rank_loads_from_counts


@dataclass(frozen=True)
class LayerProfile:
    path: str
    layer: int | None
    tokens_per_expert: tuple[int, ...]

    def loads(self, ep: int) -> RankLoads:
        if len(self.tokens_per_expert) % ep:
            raise ValueError(f"{self.path}: {len(self.tokens_per_expert)} experts not divisible by ep={ep}")
        return RankLoads(
            rank_loads_from_counts(tuple(float(c) for c in self.tokens_per_expert), ep), "histogram"
        )

    def balanced_loads(self, ep: int) -> RankLoads:
        """Rank loads under the plan's ``placement: {strategy: balanced}`` built from this profile."""
        from ..runtime.group.groups import ExpertPlacement

        placement = ExpertPlacement.balanced(self.tokens_per_expert, ep, 0)
        return RankLoads(tuple(placement.rank_loads(self.tokens_per_expert)), "histogram")


@dataclass(frozen=True)
class RoutingProfile:
    model_type: str
    num_tokens: int
    top_k: int | None
    layers: tuple[LayerProfile, ...]

    def as_dict(self, ep: int) -> dict:
        layers = []
        for lay in self.layers:
            loads = lay.loads(ep)
            layers.append(
                {
                    "path": lay.path,
                    "layer": lay.layer,
                    "tokens_per_expert": list(lay.tokens_per_expert),
                    "rank_loads": list(loads.rows),
                    "busiest_rank": loads.busiest_rank,
                    "imbalance": loads.imbalance,
                    "balanced_imbalance": lay.balanced_loads(ep).imbalance,
                }
            )
        imb = [x["imbalance"] for x in layers]
        return {
            "model_type": self.model_type,
            "num_tokens": self.num_tokens,
            "top_k": self.top_k,
            "ep": ep,
            "layers": layers,
            "mean_imbalance": sum(imb) / len(imb) if imb else 1.0,
            "mean_balanced_imbalance": (
                sum(x["balanced_imbalance"] for x in layers) / len(layers) if layers else 1.0
            ),
            "max_imbalance": max(imb, default=1.0),
        }


def _index_arg(args: tuple, kwargs: dict):
    if len(args) >= 2:
        return args[1]
    return kwargs.get("top_k_index", kwargs.get("router_indices"))


def routing_profile(model: nn.Module, batches: list[torch.Tensor], plan=None) -> RoutingProfile:
    """Run ``model`` on each ``[batch, seq]`` id tensor; count routed slots per expert per layer."""
    blocks = [
        s
        for s in find_blocks(model)
        if plan is None
        or plan.matches(s.path, type(s.block).__name__)
        or plan.matches(s.experts_path, type(s.experts).__name__)
    ]
    counts = {s.path: torch.zeros(s.num_experts, dtype=torch.int64) for s in blocks}
    top_k: dict[str, int] = {}
    handles = []

    def hook_for(path: str, n: int):
        def hook(module, args, kwargs):
            idx = _index_arg(args, kwargs)
            if isinstance(idx, torch.Tensor):
                flat = idx.reshape(-1).long()
                flat = flat[(flat >= 0) & (flat < n)]
                counts[path] += torch.bincount(flat.cpu(), minlength=n)[:n]
                top_k[path] = idx.shape[-1]

        return hook

    def rows_for(s, e: int):  # experts held as modules: each one is called with its own rows
        k = top_k_of(s.block, s.block.get_submodule(s.router_name) if s.router_name else None,
                     getattr(s.block, "config", None), getattr(model, "config", None))

        def hook(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(x, torch.Tensor):
                counts[s.path][e] += x.numel() // s.hidden_size
                if k is not None:
                    top_k[s.path] = k

        return hook

    for s in blocks:
        if s.expert_modules:
            for e, key in enumerate(experts_layout(s.experts).expert_keys):
                handles.append(s.experts.get_submodule(key).register_forward_pre_hook(rows_for(s, e),
                                                                                      with_kwargs=True))
            continue
        handles.append(s.experts.register_forward_pre_hook(hook_for(s.path, s.num_experts), with_kwargs=True))
    tokens = 0
    try:
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids)
                tokens += ids.numel()
    finally:
        for h in handles:
            h.remove()
    layers = tuple(
        LayerProfile(s.path, layer_index(s.path), tuple(int(c) for c in counts[s.path].tolist()))
        for s in blocks
    )
    k = next(iter(top_k.values()), None)
    return RoutingProfile(getattr(model.config, "model_type", "?"), tokens, k, layers)


def heatmap(profile: RoutingProfile, ep: int, out: Path) -> Path:
    """PNG: layers x experts (tokens per expert), rank boundaries for ``ep`` as vertical lines,
    each layer's imbalance written on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [lay.tokens_per_expert for lay in profile.layers]
    n_exp = max((len(r) for r in rows), default=1)
    grid = [list(r) + [0] * (n_exp - len(r)) for r in rows]
    fig_w = min(max(6.0, n_exp * 0.12 + 2.5), 18.0)
    fig_h = min(max(2.5, len(rows) * 0.28 + 1.5), 14.0)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    per = n_exp // ep if ep and n_exp % ep == 0 else None
    if per:
        for r in range(1, ep):
            ax.axvline(r * per - 0.5, color="white", linewidth=1.2)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"L{lay.layer}" if lay.layer is not None else lay.path for lay in profile.layers])
    ax.set_xlabel(f"expert (white lines: ranks of ep={ep})")
    ax.set_ylabel("MoE layer")
    for i, lay in enumerate(profile.layers):
        if per:
            ax.text(n_exp - 0.5 + n_exp * 0.01, i, f"{lay.loads(ep).imbalance:.2f}", va="center", fontsize=7)
    ax.set_title(
        f"{profile.model_type}: tokens per expert ({profile.num_tokens} tokens, top-k {profile.top_k});"
        " right: busiest rank / mean",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.06)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def from_routing_log(path: Path) -> RoutingProfile:
    """The tokens per expert of every layer summed over a training run's routing log (the
    ``hp_rewrite_routing.jsonl`` a prepared Trainer or Accelerator writes, one line per log)."""
    totals: dict[str, list[int]] = {}
    tokens: dict[str, int] = {}
    by_step = {}  # a resumed run logs its steps again from the checkpoint's: the later line of a step wins
    for line in (json.loads(text) for text in path.read_text().splitlines() if text.strip()):
        by_step[line["step"]] = line
    lines = list(by_step.values())
    for line in lines:
        for lay in line["layers"]:
            counts = totals.setdefault(lay["block"], [0] * len(lay["tokens_per_expert"]))
            totals[lay["block"]] = [a + b for a, b in zip(counts, lay["tokens_per_expert"], strict=True)]
            tokens[lay["block"]] = tokens.get(lay["block"], 0) + lay["tokens"]
    layers = tuple(LayerProfile(block, layer_index(block), tuple(c)) for block, c in totals.items())
    first = next(iter(tokens), None)
    num_tokens = tokens[first] if first is not None else 0
    top_k = sum(totals[first]) // num_tokens if num_tokens else None
    steps = sum(line["steps"] for line in lines)
    return RoutingProfile(f"{path.name} ({steps} steps)", num_tokens, top_k, layers)


def write_profile(profile: RoutingProfile, ep: int, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "profile.json"
    js.write_text(json.dumps(profile.as_dict(ep), indent=2))
    return js, heatmap(profile, ep, out_dir / "profile.png")
