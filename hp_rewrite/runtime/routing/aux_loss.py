"""The routers' losses in training: the load-balancing loss over the global batch (plan
``routing.aux_loss: global``) and the router z-loss (``routing.z_loss_coef``).

transformers computes a MoE model's auxiliary loss (``load_balancing_loss_func``, Switch Transformer's)
on each rank's micro-batch: ``E * sum_e f_e * P_e``, with ``f_e`` the fraction of the top-k slots
that chose expert ``e`` and ``P_e`` its mean router probability, over the micro-batch's layers and
unpadded tokens. A rank's micro-batch is a small and skewed sample; the global batch is the one the
loss is meant for. With ``global``, ``f`` and ``P`` are summed over every data-parallel rank (one
all-reduce per training forward; TP ranks holding the same tokens count once) and the loss is that of
the concatenated micro-batch. The z-loss (ST-MoE) is ``mean_t logsumexp(router logits_t)^2`` summed
over the layers, over the same tokens. Each rank's gradient of either is its own tokens' share, times
the number of data-parallel ranks, so an engine that averages gradients over the ranks (DDP, FSDP2)
gets exactly the gradient of the global loss: the convention of transformers' own per-rank loss.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import installed
from ..errors import ExpertParallelError


def _sums(gate_logits, num_experts: int, top_k: int, attention_mask):
    """transformers' reductions: top-k slots per expert (no gradient), router probability sums per expert,
    rows, over the layers and the unpadded tokens."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer in gate_logits:
        weights = torch.softmax(layer.to(device), dim=-1).float()
        chosen = torch.topk(weights, top_k, dim=-1)[1].reshape(-1)
        slot_mask = torch.ones_like(chosen, dtype=torch.float32) if mask is None else mask.repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).index_put_((chosen,), slot_mask, accumulate=True).detach()
        probs = probs + (weights if mask is None else weights * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    return counts, probs, rows


def _z_sums(lses, attention_mask):
    """``sum over layers and unpadded tokens of logsumexp^2`` and the unpadded tokens of one layer."""
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(lses[0].device, torch.float32)
    squares = sum((lse.square() if mask is None else lse.square() * mask).sum() for lse in lses)
    tokens = torch.full((), lses[0].shape[0], dtype=torch.float32, device=lses[0].device) if mask is None \
        else mask.sum()
    return squares, tokens


class RouterLosses:
    """The router losses of one rewritten model: the router outputs (and, with the z-loss, the logsumexp of
    the router logits) its training forward produced, captured by hooks on the routers as transformers'
    output recorders capture them; the factor the model's own ``loss`` carries the terms with (1: the
    ranks' mean convention; a prepared Trainer sets its own); ``aux_fold``: the z-loss's weight inside
    ``aux_loss`` for trainers that read only that (TRL's)."""

    def __init__(self, num_experts: int, top_k: int, *, balance_globally: bool, z_coef: float,
                 group: dist.ProcessGroup | None = None, tp_size: int = 1) -> None:
        self.num_experts, self.top_k, self.group, self.tp_size = num_experts, top_k, group, tp_size
        self.balance_globally, self.z_coef = balance_globally, z_coef
        self.loss_scale, self.aux_fold = 1.0, None
        self.captured: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None  # during a training forward

    def capture(self, router: nn.Module, args, output) -> None:
        """Forward hook of a rewritten layer's router: its first output (the logits transformers records)
        and, with the z-loss, the logsumexp of its logits. The logsumexp is taken whenever gradients are on,
        so a checkpointed forward and its recomputation run the same operations."""
        lse = None
        if self.z_coef and torch.is_grad_enabled():
            hidden = args[0].reshape(-1, args[0].shape[-1])
            bias = getattr(router, "bias", None)
            logits = F.linear(hidden.float(), router.weight.float(), None if bias is None else bias.float())
            lse = torch.logsumexp(logits, dim=-1)
        if self.captured is not None:
            if self.z_coef and lse is None:
                raise ExpertParallelError(
                    "routing.z_loss_coef: the router ran without gradients inside a training forward (reentrant "
                    "activation checkpointing), so its z-loss would train nothing; use use_reentrant=False"
                )
            self.captured.append((output[0] if isinstance(output, (tuple, list)) else output, lse))

    def _reduced(self, values: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``values`` summed over the data-parallel ranks, and how many there are."""
        if not (dist.is_available() and dist.is_initialized()):
            return values, 1
        dist.all_reduce(values, group=self.group)
        return values / self.tp_size, dist.get_world_size(self.group) // self.tp_size  # a TP group: one batch

    def losses(self, captured, attention_mask=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(global load-balancing loss or None, z-loss or None)``: each the value over the batch it is
        taken on, with this rank's share of its gradient (times the data-parallel ranks when global)."""
        e = self.num_experts
        if self.z_coef:
            squares, tokens = _z_sums([c[1] for c in captured], attention_mask)
            if not self.balance_globally:  # the z-loss on this rank's micro-batch
                return None, squares / tokens
        counts, probs, rows = _sums(tuple(c[0] for c in captured), e, self.top_k, attention_mask)
        parts = [counts, probs.detach(), rows.detach().reshape(1)]
        if self.z_coef:
            parts += [squares.detach().reshape(1), tokens.reshape(1)]
        total, ranks = self._reduced(torch.cat(parts))
        fraction, total_probs, total_rows = total[:e] / total[2 * e], total[e : 2 * e], total[2 * e]
        value = e * torch.sum(fraction * total_probs / total_rows)
        share = e * torch.sum(fraction * probs / total_rows) * ranks
        z = None
        if self.z_coef:
            z_value, z_share = total[-2] / total[-1], squares / total[-1] * ranks
            z = z_value + (z_share - z_share.detach())
        return value + (share - share.detach()), z


def _model_formula(model: nn.Module):
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def _refuse_other_balancing(model: nn.Module, num_experts, top_k) -> None:
    name, formula = type(model).__name__, _model_formula(model)
    if formula is None or not hasattr(model, "router_aux_loss_coef") or not isinstance(num_experts, int) \
            or not isinstance(top_k, int):
        raise ExpertParallelError(
            f"routing.aux_loss: global: {name} has no transformers load-balancing loss (load_balancing_loss_func, "
            "router_aux_loss_coef, num_experts, num_experts_per_tok); set routing.aux_loss: micro_batch"
        )
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(12, num_experts, generator=gen) for _ in range(2))
    mask = torch.ones(3, 4)
    mask[0, :2] = 0
    counts, probs, rows = _sums(logits, num_experts, top_k, mask)
    mine = num_experts * torch.sum((counts / rows) * (probs / rows))
    theirs = formula(logits, num_experts, top_k, mask)
    if not torch.allclose(mine, torch.as_tensor(theirs, dtype=mine.dtype), rtol=1e-5, atol=1e-7):
        raise ExpertParallelError(
            f"routing.aux_loss: global: {name}'s load-balancing loss is not transformers' usual one "
            f"({float(theirs):.6g} where it gives {float(mine):.6g}); set routing.aux_loss: micro_batch"
        )


def install_router_losses(model: nn.Module, *, balance_globally: bool, z_coef: float,
                          tp_size: int = 1) -> RouterLosses:
    """Hooks on every rewritten layer's router and ``model.forward`` wrapped (module doc). Refused for a
    model without transformers' load-balancing loss, or whose own formula is not the one computed here
    (checked on random router logits), and, with the z-loss, for a router without an ``[experts, hidden]``
    weight."""
    name = type(model).__name__
    num_experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if balance_globally:
        _refuse_other_balancing(model, num_experts, top_k)
    holders = [m for m in model.modules() if installed.router(m) is not None]
    routers = [(m, installed.router(m).router_module()) for m in holders]
    for holder, router in routers:
        weight = getattr(router, "weight", None)
        if router is None or (z_coef and not (isinstance(weight, torch.Tensor) and weight.dim() == 2)):
            what = "routing.aux_loss: global" if router is None else "routing.z_loss_coef"
            raise ExpertParallelError(
                f"{what}: the router of {type(installed.router(holder).block).__name__} in {name} is not a module with an "
                "[experts, hidden] weight; set it back to its default for this model"
            )
    losses = RouterLosses(num_experts or 0, top_k or 0, balance_globally=balance_globally, z_coef=z_coef,
                          tp_size=tp_size)
    for _, router in routers:
        router.register_forward_hook(losses.capture)
    installed.set_router_losses(model, losses)
    wrap_forward(model)
    return losses


def wrap_forward(model: nn.Module) -> None:
    """``model.forward`` (whatever it is now: TRL replaces it with its fused LM head) with the router losses."""
    installed.keep_forward_without_router_losses(model)

    @functools.wraps(type(model).forward)  # its signature: Trainer keeps the dataset columns it names
    def forward(self, *args, **kwargs):
        return _forward_with_router_losses(self, *args, **kwargs)

    forward.hp_adds_router_losses = True  # a mark on the function, not the model
    model.forward = types.MethodType(forward, model)


def is_wrapped(model: nn.Module) -> bool:
    return getattr(model.forward, "hp_adds_router_losses", False)


def _forward_with_router_losses(self, *args, **kwargs):
    """The model's forward; in a forward with gradients its ``aux_loss`` is the global batch's (instead of
    the rank's own) and its ``loss`` holds that and the z-loss. Nested (a forward that calls an earlier
    one), the outer call does it."""
    losses = installed.router_losses(self)
    if not torch.is_grad_enabled() or losses.captured is not None:  # evaluation, generation; or nested
        return installed.forward_without_router_losses(self)(*args, **kwargs)
    text = self.config.get_text_config()
    coef, config_coef = getattr(self, "router_aux_loss_coef", 0.0), getattr(text, "router_aux_loss_coef", None)
    if losses.balance_globally:  # the loss without the rank's own term (TRL's fused head reads the config)
        self.router_aux_loss_coef = 0.0
        if config_coef is not None:
            text.router_aux_loss_coef = 0.0
    losses.captured = []
    try:
        out = installed.forward_without_router_losses(self)(*args, **kwargs)
        captured = losses.captured
    finally:
        losses.captured = None
        if losses.balance_globally:
            self.router_aux_loss_coef = coef
            if config_coef is not None:
                text.router_aux_loss_coef = config_coef
    if not captured or (losses.balance_globally and getattr(out, "aux_loss", None) is None):
        raise ExpertParallelError(
            f"routing.aux_loss: global: {type(self).__name__}'s training forward computed no load-balancing loss; "
            "load the model with output_router_logits=True (TRL's trainers ask for it when router_aux_loss_coef is "
            "not 0) or set routing.aux_loss: micro_batch"
        )
    balance, z = losses.losses(captured, kwargs.get("attention_mask"))
    extra = 0.0
    if balance is not None:
        out.aux_loss = balance
        extra = coef * balance
    if z is not None:
        extra = extra + losses.z_coef * z
        if losses.aux_fold is not None:
            out.aux_loss = out.aux_loss + losses.aux_fold * z
    if getattr(out, "loss", None) is not None:
        out.loss = out.loss + losses.loss_scale * extra
    return out
