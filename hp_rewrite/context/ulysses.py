"""Ulysses attention: heads exchanged for sequence around whatever attention function the model uses.

Each rank holds its share of the sequence for every head. Before attention one all-to-all per query, key
and value gives each rank the whole sequence for ``heads / cp_size`` heads; the model's own attention
function (eager, sdpa, flash, flex: whatever transformers registers and the config names) runs on it with
the mask transformers built for the whole sequence, so causal, padding, packed (``position_ids``) and
sliding-window masking are the unmodified model's; one all-to-all gives the output back as sequence
shares of every head. Key / value heads are split the same way when the context group divides their
number; otherwise (GQA with fewer key / value heads than ranks) each is repeated for its query heads
before the exchange. Attention sinks (gpt-oss) are sliced to the rank's heads.

It is reached through transformers' attention interface: each attention module gets its own copy of its
config naming ``hp_ulysses:<inner>``, registered once per inner name; the model's config, which the masks
are built from, keeps the inner name. The attention weights are not returned (None).
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from ..runtime.transport.comm import all_to_all
from .errors import ContextParallelError
from .shard import Shares

SHARES_KW = "hp_context_shares"  # the kwarg that carries a split forward's Shares down to attention
PREFIX = "hp_ulysses:"


def _heads_to_sequence(x: torch.Tensor, shares: Shares) -> torch.Tensor:
    """``[B, H, local, D]`` (this rank's positions, every head) -> ``[B, H / cp, length, D]``."""
    b, heads, local, d = x.shape
    cp = shares.size
    h = heads // cp
    rows = x.reshape(b, cp, h, local, d).permute(1, 3, 0, 2, 4).reshape(cp * local, b * h * d)
    got = all_to_all(rows, shares.lengths, [local] * cp, shares.group)
    return got.reshape(shares.length, b, h, d).permute(1, 2, 0, 3).contiguous()


def _sequence_to_heads(out: torch.Tensor, shares: Shares) -> torch.Tensor:
    """Attention's output ``[B, length, H / cp, D]`` -> ``[B, local, H, D]``."""
    b, length, h, d = out.shape
    cp = shares.size
    local = shares.lengths[shares.rank]
    rows = out.permute(1, 0, 2, 3).reshape(length, b * h * d)
    got = all_to_all(rows, [local] * cp, shares.lengths, shares.group)
    return got.reshape(cp, local, b, h, d).permute(2, 1, 0, 3, 4).reshape(b, local, cp * h, d)


class _LocalHeads:
    """The attention module as the inner function sees it on this rank's heads: ``overrides`` first,
    then the module's own attributes."""

    def __init__(self, module: nn.Module, **overrides) -> None:
        self.__dict__.update(overrides, _module=module)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


def _inner_function(module: nn.Module, inner: str):
    if inner == "eager":  # the model's own eager function (gpt-oss's adds sinks), as its attention would
        found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if found is None:
            raise ContextParallelError(
                f"cp_size: {type(module).__name__} runs eager attention but its module has no eager_attention_forward "
                "to run on the exchanged heads; load the model with attn_implementation='sdpa'")
        return found
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[inner]


def _ulysses(inner: str):
    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        shares = kwargs.pop(SHARES_KW, None)
        function = _inner_function(module, inner)
        if shares is None:  # not split (generate): the whole sequence on every rank
            return function(module, query, key, value, attention_mask, **kwargs)
        heads, kv_heads, cp = query.shape[1], key.shape[1], shares.size
        if heads % cp:
            raise ContextParallelError(
                f"cp_size {cp} does not divide the {heads} attention heads of {type(module).__name__}: choose a "
                "cp_size that divides the number of attention heads")
        overrides = {}
        if kv_heads % cp:  # fewer key / value heads than ranks: each repeated for its query heads
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
            overrides["num_key_value_groups"] = 1
        start, end = shares.rank * heads // cp, (shares.rank + 1) * heads // cp
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, torch.Tensor) and sinks.shape[:1] == (heads,):
            overrides["sinks"] = sinks[start:end]
        if isinstance(kwargs.get("s_aux"), torch.Tensor) and kwargs["s_aux"].shape[:1] == (heads,):
            kwargs["s_aux"] = kwargs["s_aux"][start:end]
        query, key, value = (_heads_to_sequence(t, shares) for t in (query, key, value))
        out, _ = function(_LocalHeads(module, **overrides), query, key, value, attention_mask, **kwargs)
        return _sequence_to_heads(out, shares), None

    return attention


def use_ulysses(attention_modules: list[nn.Module]) -> None:
    """Point each attention module's config at the Ulysses wrapper of its own attention function."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    copies: dict[int, object] = {}
    for module in attention_modules:
        config = module.config
        inner = config._attn_implementation or "eager"
        if inner.startswith(PREFIX):
            continue
        if inner != "eager" and inner not in ALL_ATTENTION_FUNCTIONS:
            raise ContextParallelError(
                f"cp_size: {type(module).__name__} uses attention {inner!r}, which transformers' attention "
                "interface does not know; load the model with attn_implementation='sdpa'")
        name = PREFIX + inner
        if name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, _ulysses(inner))
        if id(config) not in copies:
            copies[id(config)] = copy.copy(config)
            copies[id(config)]._attn_implementation_internal = name
        module.config = copies[id(config)]
