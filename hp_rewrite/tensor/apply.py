"""Apply a :class:`~.layout.TensorLayout` with torch's DTensor tensor-parallel API, and the sequence-
parallel boundaries around it.

Without sequence parallelism every activation between the modules is replicated over the TP group:
an attention or MLP is column- then row-parallel (its output all-reduced), the MoE block runs on all
tokens and dispatches only this rank's share (:mod:`hp_rewrite.runtime.group.tokens`), and every whole
parameter gets the same, complete gradient on every rank of the group.

With sequence parallelism the residual stream and the decoder norms hold this rank's chunk of the
sequence (``[B, S/tp, H]``): the first decoder layer takes its chunk, an attention or MLP gathers the
sequence on entry and its row-parallel output is reduce-scattered back onto it, the MoE block gathers
on entry and keeps its chunk of the output on exit, the last decoder layer gathers the sequence for
the final norm and the head. The norms' weights are replicated DTensors whose gradients are partial
sums (DTensor's ``Partial``): :func:`hp_rewrite.sync_gradients` reduces them over the group.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..runtime.group import tokens
from .comm import sum_grads
from .errors import TensorParallelError
from .layout import COLWISE, HEAD_NORM, MLA_ROPE, ROWWISE, TensorLayout
from .regather import Regather

SEQ = 1  # the sequence dimension of the residual stream [B, S, H]


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output, value):
    return (value, *output[1:]) if isinstance(output, tuple) else value


class _Boundary:
    """The TP group a hook exchanges over."""

    def __init__(self, mesh) -> None:
        self.group, self.rank, self.size = mesh.get_group(), mesh.get_local_rank(), mesh.size()

    def check(self, hidden: torch.Tensor, where: str) -> None:
        if hidden.shape[SEQ] % self.size:
            raise TensorParallelError(
                f"sequence_parallel: the sequence length {hidden.shape[SEQ]} at {where} is not divisible by "
                f"tp_size {self.size}; pad the batch to a multiple of tp_size, or set sequence_parallel: false "
                "(without gradients, as in generate, such a sequence runs with the residual stream replicated)"
            )

    def check_same_batch(self, hidden: torch.Tensor) -> None:
        """The ranks of a TP group must hold one batch, in one order; a sampler over the world gives each its
        own, which would run without an error and train on a mix. Compared once, at the first forward."""
        if not tokens.same_on_every_rank(hidden, self.group, self.size):
            raise TensorParallelError(
                "tp_size > 1: the ranks of a TP group got different batches (or one in different orders); give the tp_size consecutive ranks "
                "of a group the same batch (their data-parallel rank is rank // tp_size, e.g. a DistributedSampler "
                "with num_replicas=world_size // tp_size, rank=rank // tp_size)"
            )

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        return tokens.gather(hidden, self.group, self.rank, self.size, hidden.shape[SEQ] * self.size, SEQ)

    def share(self, hidden: torch.Tensor) -> torch.Tensor:
        return tokens.share(hidden, self.group, self.rank, self.size, SEQ)


def _on_hidden(fn):
    """A forward pre-hook applying ``fn`` to the module's ``hidden_states`` (first positional or by name)."""
    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        raise TensorParallelError(f"sequence_parallel: {type(module).__name__} was called without hidden states")
    return hook


def parallelize(model: nn.Module, layout: TensorLayout, mesh, sequence_parallel: bool) -> None:
    """Split ``model``'s dense modules over the 1-D ``mesh`` (the TP group) as ``layout`` says, in place."""
    reduce_scattered = set()
    if sequence_parallel:  # a mixer's row-parallel output goes back onto this rank's sequence chunk
        reduce_scattered = {p for m in layout.mixers for p, s in layout.styles.items()
                            if s == ROWWISE and p.startswith(m + ".")}
    edge, state = _Boundary(mesh), {"checked": False, "sharded": False}
    for path, style in layout.styles.items():
        module = model.get_submodule(path)
        if style == COLWISE:
            parallelize_module(module, mesh, ColwiseParallel())
        elif style == ROWWISE and path in reduce_scattered:  # the partial sums, placed per forward below
            parallelize_module(module, mesh, RowwiseParallel(output_layouts=Partial(), use_local_output=False))
            module.register_forward_hook(lambda m, a, out: out.redistribute(
                out.device_mesh, [Shard(SEQ) if state["sharded"] else Replicate()]).to_local())
        elif style == ROWWISE:
            parallelize_module(module, mesh, RowwiseParallel(output_layouts=Replicate()))
        elif style == HEAD_NORM:  # fed this rank's heads (dim 2 of [B, S, heads, head_dim])
            parallelize_module(module, mesh, SequenceParallel(sequence_dim=2, use_local_output=True))
        elif style == MLA_ROPE:
            module.register_forward_hook(_rope_grads(mesh.get_group(), layout.rope_width[path]))
    first, last = model.get_submodule(layout.layers[0]), model.get_submodule(layout.layers[-1])

    def enter(hidden):
        if not state["checked"]:
            edge.check_same_batch(hidden)
            state["checked"] = True
        # a sequence the group cannot split (generate's one-token decode steps) runs with the residual
        # stream replicated; only without gradients: the norms' would then be summed tp times
        state["sharded"] = sequence_parallel and not (hidden.shape[SEQ] % edge.size and not torch.is_grad_enabled())
        if not state["sharded"]:
            return hidden
        edge.check(hidden, layout.layers[0])
        return edge.share(hidden)

    first.register_forward_pre_hook(_on_hidden(enter), with_kwargs=True)
    model.register_forward_pre_hook(_refuse_partial_outputs(sequence_parallel), with_kwargs=True)
    if sequence_parallel:
        _sequence_boundaries(model, layout, mesh, edge, state, last)


def _refuse_partial_outputs(sequence_parallel: bool):
    """Outputs a rank holds only its share of: its heads' attention weights; under SP, its chunk of the
    layers' hidden states. Returned as they are they would look like the whole."""
    def hook(module, args, kwargs):
        config = getattr(module, "config", None)

        def asked(name: str) -> bool:
            value = kwargs.get(name)
            return bool(getattr(config, name, False) if value is None else value)

        if asked("output_attentions"):
            raise TensorParallelError("output_attentions with tp_size > 1: each rank holds only its own heads' "
                                      "attention weights; ask for them with a plan of tp_size: 1")
        if sequence_parallel and asked("output_hidden_states"):
            raise TensorParallelError("output_hidden_states with sequence_parallel: each rank holds only its chunk "
                                      "of the sequence between the layers; set sequence_parallel: false to get them")
    return hook


def _sequence_boundaries(model: nn.Module, layout: TensorLayout, mesh, edge: _Boundary, state: dict,
                         last: nn.Module) -> None:
    """The norms sequence-sharded; attention, MLPs and the MoE block gather on entry (keeping a chunk
    for backward) and give back their chunk; the last layer gathers for the head."""
    regather = Regather()
    for path in layout.norms:
        parallelize_module(model.get_submodule(path), mesh, SequenceParallel(sequence_dim=SEQ, use_local_output=True))

    def gather_in(hidden):
        if not state["sharded"]:
            return hidden
        full = edge.gather(hidden).contiguous()
        regather.enter(hidden, full, edge)  # backward keeps this rank's chunk only (.regather)
        return full

    def leave(module, args, out):
        if state["sharded"]:
            regather.leave()

    def leave_block(module, args, out):  # the MoE block keeps this rank's chunk of its output
        if not state["sharded"]:
            return out
        regather.leave()
        return _replace_first(out, edge.share(_first(out)))

    for path in layout.mixers:
        mixer = model.get_submodule(path)
        mixer.register_forward_pre_hook(_on_hidden(gather_in), with_kwargs=True)
        mixer.register_forward_hook(leave)
    for path in layout.moe:
        block = model.get_submodule(path)
        block.register_forward_pre_hook(_on_hidden(gather_in), with_kwargs=True)
        block.register_forward_hook(leave_block)
    last.register_forward_hook(
        lambda m, a, out: _replace_first(out, edge.gather(_first(out))) if state["sharded"] else out)


def _rope_grads(group, width: int):
    """MLA: the rotary columns of ``kv_a_proj_with_mqa`` feed every head, this rank's only here; their
    gradient is summed over the group (the latent columns reach it whole through ``kv_b_proj``)."""
    def hook(module, args, out):
        latent, rope = out[..., :-width], out[..., -width:]
        return torch.cat([latent, sum_grads(rope, group)], dim=-1)
    return hook
