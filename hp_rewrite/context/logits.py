"""``context.logits: local``: the head runs on this rank's positions only, and the loss is still the whole's.

By default the decoder's output is gathered and every rank of a context group computes the head over the
whole sequence: ``[B, S, vocab]`` logits per rank, the largest activation of a long-sequence step (32k
tokens x 151k vocabulary in fp32: 19 GB). With ``local`` the last hidden state stays this rank's share, so
the logits a forward returns are ``[B, local, vocab]`` (positions ``model.hp_rewrite.context.shares(S).mine``)
and the head costs ``1 / cp_size`` of its compute and memory.

The loss stays the unmodified model's: the labels are shifted over the whole sequence first (the label of a
rank's last position is the next rank's first token), this rank's positions of them are scored by the
model's own ``loss_function`` against the whole sequence's count of labelled tokens (``num_items_in_batch``
when the caller passes one, as Trainer does), and the parts are summed over the context group. The sum's
backward is a sum too, so every rank's share of the gradient arrives ``cp_size`` times: the convention the
gathered path keeps (:mod:`.shard`). The returned logits carry the same factor in their backward, so a loss
the caller computes from them gets the same gradients when each rank backpropagates only its own part:
summed over this rank's positions (labels shifted over the whole sequence), divided by the whole sequence's
count; sum the parts' values over the group without autograd to log the loss (a differentiable sum would
apply the factor twice).

A forward that asks for something the local logits cannot give runs whole, as without the knob:
``logits_to_keep`` (the last positions, which one rank holds) and TRL's fused head (``fused_lm_head``,
which never builds the logits anyway).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from .errors import ContextParallelError

IGNORE_INDEX = -100


class LocalLoss:
    """The model's ``loss_function`` on this rank's positions (module doc); ``state`` is the install's
    :class:`~.install.ContextSplit`, whose ``local_shares`` the decoder's hook sets for a forward kept local."""

    def __init__(self, inner, state) -> None:
        self.inner, self.state = inner, state  # a deep copy of the model copies both (ContextSplit.__deepcopy__)

    def __call__(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                 shift_labels=None, **kwargs):
        shares = self.state.local_shares
        if shares is None:  # a forward that ran whole
            return self.inner(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                              ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        start, end = shares.mine
        count = (shift_labels != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
        part = self.inner(logits, labels, vocab_size, num_items_in_batch=count, ignore_index=ignore_index,
                          shift_labels=shift_labels[..., start:end].contiguous(), **kwargs)
        return _summed_over_group(part, shares.group)


class _SumOverGroup(Function):
    """All-reduce (sum) forward; the gradient's sum over the group backward (each rank's gradient of the
    summed loss reaches every rank's part)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@torch.compiler.disable  # a collective on a scalar: outside the compiled graph
def _summed_over_group(part: torch.Tensor, group) -> torch.Tensor:
    return _SumOverGroup.apply(part, group)


class _ScaledBackward(Function):
    """Identity forward; the gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx, x, factor):  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.factor, None


def install_local_logits(model: nn.Module, state) -> None:
    """Keep the logits local on ``model`` (module doc); refused, by field, for a model whose loss is not
    transformers' causal-LM loss (its labels could not be shifted before the split)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    inner = getattr(model, "loss_function", None)
    if inner is not ForCausalLMLoss:
        raise ContextParallelError(
            f"context.logits: local: {type(model).__name__}'s loss is not transformers' causal-LM loss "
            f"({getattr(inner, '__name__', inner)!r}), so its labels cannot be shifted over the whole sequence "
            "before the split; set context.logits: whole")
    model.loss_function = LocalLoss(inner, state)
    model.register_forward_pre_hook(_note_request, with_kwargs=True)
    model.register_forward_hook(_done, with_kwargs=True, always_call=True)  # a forward that raised too


def _state(model: nn.Module):
    """The split state of this model (of a deep copy: its own), held by its loss function."""
    return model.loss_function.state


def _note_request(module, args, kwargs):
    keep = kwargs.get("logits_to_keep", 0)
    whole = kwargs.get("fused_lm_head", False) or not (isinstance(keep, int) and keep == 0)
    _state(module).begin_forward(local=not whole)


def _done(module, args, kwargs, output):
    state = _state(module)
    shares = state.local_shares
    state.begin_forward(local=False)
    if shares is None or output is None:  # ran whole, or raised
        return None
    if not hasattr(output, "logits"):
        raise ContextParallelError(
            f"context.logits: local: {type(module).__name__} returned a {type(output).__name__}, not an output "
            "with logits (return_dict=False?); call it with return_dict=True, or set context.logits: whole")
    if isinstance(output.logits, torch.Tensor) and output.logits.requires_grad:
        output.logits = _ScaledBackward.apply(output.logits, shares.size)
    return output

