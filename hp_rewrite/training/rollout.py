"""Rollout routing replay (R3): the experts the inference engine chose while rolling out, replayed in
the training forwards, so that the policy trained is the one that sampled (without it about one router
in ten disagrees per forward and GRPO runs of Qwen3-30B-A3B collapse).

The engines' layout, per sequence (prompt and completion, ``N`` tokens): ``[N - 1, num_hidden_layers,
top_k]`` integers, row ``t`` the experts token ``t`` went to in every decoder layer (indexed by the
layer's absolute position; dense layers hold zeros; the last token is never forwarded). vLLM returns it
as ``CompletionOutput.routed_experts`` (``enable_return_routed_experts=True``), SGLang as
``meta_info["routed_experts"]`` (base64 of int32, :func:`sglang_routed_experts`).

:func:`rollout_routes` places each sequence's routes at its tokens in a padded training batch (content
checked, so a sample matched to the wrong routes is an error, not a silent misroute) and returns
:class:`~hp_rewrite.runtime.routing.replay.Routes` for :func:`~hp_rewrite.runtime.routing.replay.replay_routing`, one
forward per chunk of rows; positions without routes (padding, the last token) are routed by the router.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import torch
from torch import nn

from ..runtime.errors import ExpertParallelError
from ..runtime.routing.replay import Routes, _layers


@dataclass
class Rollout:
    """One sampled sequence as the engine returned it: its prompt and completion token ids and its routes
    (``[len(prompt) + len(completion) - 1, num_hidden_layers, top_k]``)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    routed_experts: torch.Tensor


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def moe_layer_indices(model: nn.Module) -> dict[str, int]:
    """Each rewritten MoE layer (its experts holder's path, as :class:`Routes` keys it) -> the index of its
    decoder layer, which is how the engines index their routes."""
    layers = _layers(model)
    count = getattr(_text_config(model), "num_hidden_layers", None)
    found = {}
    for name in layers:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit() and i:
                parent = model.get_submodule(".".join(parts[:i]))
                if isinstance(parent, nn.ModuleList) and (count is None or len(parent) == count):
                    found[name] = int(part)
                    break
        else:
            raise ExpertParallelError(
                f"rollout routes: the MoE layer {name} is not inside the model's list of {count} decoder layers, so "
                "which column of the engine's routes is its own is not known")
    return found


def sglang_routed_experts(meta_info: dict, model: nn.Module) -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` (``return_routed_experts=True``; base64 of int32) as the
    ``[N - 1, num_hidden_layers, top_k]`` tensor a :class:`Rollout` takes."""
    encoded = meta_info.get("routed_experts")
    if encoded is None:
        raise ExpertParallelError("rollout routes: this SGLang output has no meta_info['routed_experts']; start the "
                                  "server with --enable-return-routed-experts and ask with return_routed_experts=True")
    config = _text_config(model)
    flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
    return flat.reshape(-1, config.num_hidden_layers, config.num_experts_per_tok)


def _top_k(model: nn.Module, layers: dict) -> int:
    ks = {layer.top_k for layer in layers.values()}
    if len(ks) != 1 or None in ks:
        raise ExpertParallelError(f"rollout routes: the MoE layers route to {sorted(map(str, ks))} experts per token; "
                                  "replaying an engine's routes needs one top-k for every layer")
    return ks.pop()


def place_rollouts(model, rollouts: list[Rollout], input_ids: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """``[B, S, moe layers, K]``: each row's routes at its tokens (its prompt ends at ``prompt_width``),
    ``-1`` elsewhere; the batch's tokens must be the rollouts'."""
    layers = _layers(model)
    columns = torch.tensor(list(moe_layer_indices(model).values()))
    k, count = _top_k(model, layers), getattr(_text_config(model), "num_hidden_layers", None)
    experts = max(layer.widths[0] for layer in layers.values())
    rows, width = input_ids.shape
    if len(rollouts) != rows:
        raise ExpertParallelError(f"rollout routes: {len(rollouts)} rollouts for a batch of {rows} rows")
    small = torch.int16 if experts <= torch.iinfo(torch.int16).max else torch.int32
    placed = torch.full((rows, width, len(columns), k), -1, dtype=small)
    tokens = input_ids.cpu()
    for b, r in enumerate(rollouts):
        seq = torch.tensor(list(r.prompt_ids) + list(r.completion_ids), dtype=tokens.dtype)
        start, n = prompt_width - len(r.prompt_ids), seq.numel()
        routes = torch.as_tensor(r.routed_experts)
        if start < 0 or start + n > width or not torch.equal(tokens[b, start:start + n], seq):
            raise ExpertParallelError(
                f"rollout routes: row {b} of the training batch is not the sequence its routes were recorded for (a "
                f"{len(r.prompt_ids)}-token prompt and a {len(r.completion_ids)}-token completion); the rollouts must "
                "be given in the batch's row order")
        if routes.dim() != 3 or routes.shape[0] != n - 1 or routes.shape[2] != k or (
                count is not None and routes.shape[1] != count):
            raise ExpertParallelError(
                f"rollout routes: row {b}'s routes are {list(routes.shape)}, where the engines give [{n - 1}, "
                f"{count}, {k}] for {n} tokens (tokens - 1, num_hidden_layers, top_k)")
        chosen = routes[: n - 1].index_select(1, columns)
        if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= experts):
            raise ExpertParallelError(f"rollout routes: row {b}'s routes name experts outside 0..{experts - 1}")
        placed[b, start:start + n - 1] = chosen.to(small)
    return placed


def rollout_routes(model: nn.Module, rollouts: list[Rollout], input_ids: torch.Tensor, prompt_width: int,
                   batch_size: int | None = None) -> Routes:
    """:class:`Routes` replaying ``rollouts`` (one per row of ``input_ids``, the prompts left-padded to
    ``prompt_width`` and the completions after them, as TRL batches them) in forwards of ``batch_size``
    rows (all at once by default), on the batch's device."""
    return routes_of_placed(model, place_rollouts(model, rollouts, input_ids, prompt_width), batch_size, input_ids.device)


def routes_of_placed(model: nn.Module, placed: torch.Tensor, batch_size: int | None = None,
                     device: torch.device | None = None) -> Routes:
    """The forwards' :class:`Routes` of a ``[B, S, moe layers, K]`` placement, ``batch_size`` rows each."""
    placed = placed.to(device if device is not None else placed.device, non_blocking=True)
    rows, step = placed.shape[0], batch_size or placed.shape[0]
    return Routes({name: [placed[s:s + step, :, j].reshape(-1, placed.shape[-1]) for s in range(0, rows, step)]
                   for j, name in enumerate(moe_layer_indices(model))})


def engine_layout(model: nn.Module, routes: Routes, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """The engines' per-sequence layout of one recorded forward over a padded batch (its real tokens
    contiguous in each row, as ``attention_mask`` marks them): ``[N - 1, num_hidden_layers, top_k]`` int32
    per row, dense layers zero, what vLLM would have returned for the same routing."""
    columns = moe_layer_indices(model)
    count = getattr(_text_config(model), "num_hidden_layers", None) or max(columns.values()) + 1
    rows, width = attention_mask.shape
    out = []
    for b in range(rows):
        real = attention_mask[b].nonzero().flatten()
        start, n = int(real[0]), real.numel()
        per_layer = {}
        for name, calls in routes.layers.items():
            if len(calls) != 1:
                raise ExpertParallelError(f"engine_layout: {name} has {len(calls)} recorded forwards; record one")
            per_layer[name] = calls[0].reshape(rows, width, -1)[b, start:start + n - 1]
        k = next(iter(per_layer.values())).shape[-1]
        seq = torch.zeros(n - 1, count, k, dtype=torch.int32)
        for name, chosen in per_layer.items():
            seq[:, columns[name]] = chosen.to(torch.int32)
        out.append(seq)
    return out
