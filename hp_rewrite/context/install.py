"""Make a loaded model context-parallel: hooks on its decoder, Ulysses attention in its attention modules.

The decoder (``model.get_decoder()``, the module holding ``layers``) is left as transformers wrote it:

* before it runs, a pre-hook hands every decoder layer and attention call this forward's
  :class:`~.shard.Shares` through the keyword arguments transformers already passes down (so activation
  checkpointing's recomputation sees the same). Masks and position ids are built by the decoder for the
  whole sequence, as it builds them: with the cache it makes for itself when ``use_cache`` is on (which
  decides, for one, whether packed ``position_ids`` separate sequences); that cache holds this rank's
  shares, nothing a later call could continue from, so the output carries none.
* the first layer takes this rank's share of the embeddings; every layer takes its share of the position
  embeddings;
* after it, the last hidden state (unless the plan keeps the logits local, :mod:`.logits`), any recorded
  hidden states and router logits are gathered whole.

A forward given a cache (``generate`` passes one) is not split: every rank of the group runs the whole
sequence, in lockstep with the expert exchange as without context parallelism. Nor is a sequence shorter
than the group (a rank would hold no position, which models' ``view(batch, length, -1, head_dim)`` cannot
take); a longer one that the group does not divide is split unevenly, ``torch.tensor_split``'s way.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..runtime.group.tokens import same_on_every_rank
from .errors import ContextParallelError
from .logits import install_local_logits
from .shard import Shares, gather_sequence, gather_token_rows, share_sequence
from .ulysses import SHARES_KW, use_ulysses


class ContextSplit:
    """What an install leaves on the model (``model.hp_rewrite.context``): the group and the modules."""

    def __init__(self, group, rank: int, size: int, decoder: nn.Module, attention: list[nn.Module]) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.decoder, self.attention = decoder, attention
        self.checked = False
        self.want_local, self.local_shares = False, None  # context.logits: local (:mod:`.logits`)

    def __deepcopy__(self, memo) -> ContextSplit:
        """A deep copy of the model (a reference model, an EMA copy) gets its own state over the same group
        (process groups are shared, not copied), pointing at the copy's modules."""
        twin = copy.copy(self)
        memo[id(self)] = twin
        twin.decoder = copy.deepcopy(self.decoder, memo)
        twin.attention = copy.deepcopy(self.attention, memo)
        twin.want_local, twin.local_shares = False, None
        return twin

    def begin_forward(self, local: bool) -> None:
        """Whether the model's forward now starting keeps its last hidden state (so its logits) local."""
        self.want_local, self.local_shares = local, None

    def shares(self, length: int) -> Shares:
        return Shares(self.group, self.rank, self.size, length)

    def check_same_batch(self, ids: torch.Tensor) -> None:
        """The ranks of a context group must hold one batch, in one order: a sampler over the world gives each
        its own, which would run without an error and train on a mix. Compared once, at the first split
        forward."""
        if self.checked:
            return
        if not same_on_every_rank(ids, self.group, self.size):  # in order: rows in another order split wrongly
            raise ContextParallelError(
                "cp_size > 1: the ranks of a context group got different batches (or one in different orders); give "
                "the cp_size consecutive ranks of a group the same batch (their data-parallel rank is rank // cp_size, e.g. a "
                "DistributedSampler with num_replicas=world_size // cp_size, rank=rank // cp_size)")
        self.checked = True


def _decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    for candidate in (decoder, getattr(model, "base_model", None), model, *model.modules()):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return candidate, layers
    raise ContextParallelError(
        f"cp_size > 1: {type(model).__name__} has no decoder with a 'layers' list (transformers' decoder-only "
        "layout), so its sequence cannot be split; set cp_size: 1")


def _attention_modules(layer: nn.Module, index: int) -> list[nn.Module]:
    found = [m for m in layer.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "config")]
    if not found:
        raise ContextParallelError(
            f"cp_size > 1: decoder layer {index} ({type(layer).__name__}) has no attention module that calls "
            "transformers' attention interface (with num_key_value_groups and config); set cp_size: 1")
    return found


def _first_tensor(args, kwargs, name: str):
    return kwargs[name] if name in kwargs else (args[0] if args else None)


def _share_positions(value, shares: Shares):
    """The position embeddings (a tensor or a tuple of them, ``[B, length, ...]``) at this rank's positions."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == shares.length:
        return share_sequence(value, shares)
    if isinstance(value, tuple):
        return tuple(_share_positions(v, shares) for v in value)
    return value


def install_context(model: nn.Module, group, rank: int, size: int, tp_size: int = 1,
                    local_logits: bool = False) -> ContextSplit:
    """Split ``model``'s sequences over the context ``group`` (module doc); refused, naming what is missing,
    for a model without transformers' decoder layout or attention interface, or heads ``size`` cannot split
    (a TP group's ``tp_size`` ranks already hold ``heads / tp_size`` each). ``local_logits``: the plan's
    ``context.logits: local`` (:mod:`.logits`)."""
    decoder, layers = _decoder(model)
    attention = [m for i, layer in enumerate(layers) for m in _attention_modules(layer, i)]
    heads = getattr(attention[0].config, "num_attention_heads", None)
    if isinstance(heads, int) and heads % (size * tp_size):
        sizes, share = (f"cp_size {size} x tp_size {tp_size}", "heads / (tp_size x cp_size)") if tp_size > 1 else \
            (f"cp_size {size}", "heads / cp_size")
        raise ContextParallelError(
            f"{sizes} does not divide {type(model).__name__}'s {heads} attention heads (Ulysses gives each rank "
            f"{share} of them): choose sizes that divide it")
    use_ulysses(attention)
    state = ContextSplit(group, rank, size, decoder, attention)
    decoder.hp_context_split = state  # the hooks read it from the module: a deep copy's hooks find the copy's

    def enter(module, args, kwargs):
        state = module.hp_context_split
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return None  # generate's (or a decoding loop's) forward: the whole sequence on every rank
        ids = kwargs.get("input_ids", args[0] if args else None)
        source = ids if ids is not None else kwargs.get("inputs_embeds")
        if source is None:
            return None
        state.check_same_batch(source)
        if source.shape[1] < state.size:  # a rank would hold no position, which models cannot view: unsplit
            return None
        return args, {**kwargs, SHARES_KW: state.shares(source.shape[1])}

    def first_layer(module, args, kwargs):
        shares = kwargs.get(SHARES_KW)
        if shares is None:
            return None
        hidden = _first_tensor(args, kwargs, "hidden_states")
        if hidden.shape[1] == shares.length:
            hidden = share_sequence(hidden, shares)
        args = (hidden, *args[1:]) if "hidden_states" not in kwargs else args
        kwargs = {**kwargs, **({"hidden_states": hidden} if "hidden_states" in kwargs else {})}
        return args, _with_positions(kwargs, shares)

    def every_layer(module, args, kwargs):
        shares = kwargs.get(SHARES_KW)
        return None if shares is None else (args, _with_positions(kwargs, shares))

    def leave(module, args, kwargs, output):
        shares = kwargs.get(SHARES_KW)
        if shares is None:
            return None
        state = module.hp_context_split
        if getattr(output, "past_key_values", None) is not None:
            output.past_key_values = None  # a cache the decoder made for itself: this rank's shares only
        batch = output.last_hidden_state.shape[0]
        if state.want_local:  # context.logits: local: the head and the loss on this rank's positions
            state.want_local, state.local_shares = False, shares  # this forward's (a direct decoder call: whole)
        else:
            output.last_hidden_state = gather_sequence(output.last_hidden_state, shares)
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(h if h.shape[1] == shares.length else gather_sequence(h, shares)
                                         for h in output.hidden_states)
        if getattr(output, "router_logits", None) is not None:
            output.router_logits = tuple(_gather_router_logits(r, shares, batch) for r in output.router_logits)
        return output

    decoder.register_forward_pre_hook(enter, with_kwargs=True)
    layers[0].register_forward_pre_hook(first_layer, with_kwargs=True)
    for layer in layers[1:]:
        layer.register_forward_pre_hook(every_layer, with_kwargs=True)
    decoder.register_forward_hook(leave, with_kwargs=True)
    if local_logits:
        install_local_logits(model, state)
    return state


def _with_positions(kwargs: dict, shares: Shares) -> dict:
    if kwargs.get("position_embeddings") is None:
        return kwargs
    return {**kwargs, "position_embeddings": _share_positions(kwargs["position_embeddings"], shares)}


def _gather_router_logits(logits, shares: Shares, batch: int):
    if not isinstance(logits, torch.Tensor):
        return logits
    if logits.dim() == 3:  # [B, local, experts]
        return gather_sequence(logits, shares)
    return gather_token_rows(logits, shares, batch)
