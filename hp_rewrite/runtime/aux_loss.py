"""The load-balancing loss over the global batch (plan ``routing.aux_loss: global``).

transformers computes a MoE model's auxiliary loss (``load_balancing_loss_func``, Switch Transformer's)
on each rank's micro-batch: ``E * sum_e f_e * P_e``, with ``f_e`` the fraction of the top-k slots
that chose expert ``e`` and ``P_e`` its mean router probability, over the micro-batch's layers and
unpadded tokens. A rank's micro-batch is a small and skewed sample; the global batch is the one the
loss is meant for. Here ``f`` and ``P`` are summed over every data-parallel rank (one all-reduce of
``2E + 1`` floats per forward; TP ranks holding the same tokens count once) and the loss is that of the
concatenated micro-batch. Each rank's gradient is its own tokens' share of it, times the number of
data-parallel ranks, so an engine that averages gradients over the ranks (DDP, FSDP2) gets exactly the
gradient of the global loss: the convention of transformers' own per-rank loss.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.distributed as dist
from torch import nn

from .errors import ExpertParallelError


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


class GlobalAuxLoss:
    """``routing.aux_loss: global`` for one rewritten model: the router outputs its training forward
    produced (captured by hooks on the routers, as transformers' output recorders capture them), the
    loss, and the factor the model's own ``loss`` carries it with (1: the ranks' mean convention; a
    prepared Trainer sets its own)."""

    def __init__(self, num_experts: int, top_k: int, group: dist.ProcessGroup | None = None, tp_size: int = 1):
        self.num_experts, self.top_k, self.group, self.tp_size = num_experts, top_k, group, tp_size
        self.loss_scale = 1.0
        self.captured: list[torch.Tensor] | None = None  # during a training forward

    def capture(self, router: nn.Module, args, output) -> None:
        """Forward hook of a rewritten layer's router: its first output, the logits transformers records."""
        if self.captured is not None:
            self.captured.append(output[0] if isinstance(output, (tuple, list)) else output)

    def __call__(self, gate_logits, attention_mask=None) -> torch.Tensor:
        """The global loss's value on every rank, with this rank's share of its gradient (times the
        data-parallel ranks)."""
        counts, probs, rows = _sums(gate_logits, self.num_experts, self.top_k, attention_mask)
        ranks = 1
        packed = torch.cat([counts, probs.detach(), rows.detach().reshape(1)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed, group=self.group)
            packed = packed / self.tp_size  # the TP ranks of a group hold the same tokens
            ranks = dist.get_world_size(self.group) // self.tp_size
        e = self.num_experts
        fraction, total_probs, total_rows = packed[:e] / packed[-1], packed[e : 2 * e], packed[-1]
        value = e * torch.sum(fraction * total_probs / total_rows)
        share = e * torch.sum(fraction * probs / total_rows) * ranks
        return value + (share - share.detach())


def _model_formula(model: nn.Module):
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def install_global_aux(model: nn.Module, tp_size: int = 1) -> GlobalAuxLoss:
    """Wrap ``model.forward`` so a training forward's ``aux_loss`` is the global batch's (module doc).

    Refused for a model without transformers' load-balancing loss, or whose own formula is not the one
    computed here (checked on random router logits)."""
    name = type(model).__name__
    formula = _model_formula(model)
    num_experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
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
    aux = GlobalAuxLoss(num_experts, top_k, tp_size=tp_size)
    routers = [vars(m)["hp_router"].router_module() for m in model.modules() if vars(m).get("hp_router") is not None]
    if not routers or any(r is None for r in routers):
        raise ExpertParallelError(f"routing.aux_loss: global: a rewritten layer of {name} has no router module")
    for router in routers:
        router.register_forward_hook(aux.capture)
    model.hp_global_aux = aux
    wrap_forward(model)
    return aux


def wrap_forward(model: nn.Module) -> None:
    """``model.forward`` (whatever it is now: TRL replaces it with its fused LM head) under the global loss."""
    model.hp_forward_without_global_aux = model.forward

    @functools.wraps(type(model).forward)  # its signature: Trainer keeps the dataset columns it names
    def forward(self, *args, **kwargs):
        return _forward_with_global_aux(self, *args, **kwargs)

    forward.hp_global_aux = True
    model.forward = types.MethodType(forward, model)


def is_wrapped(model: nn.Module) -> bool:
    return getattr(model.forward, "hp_global_aux", False)


def _forward_with_global_aux(self, *args, **kwargs):
    """The model's forward; in a forward with gradients its ``aux_loss`` is the global batch's and its
    ``loss`` holds that one instead of the rank's own. Nested (a forward that calls an earlier one), the
    outer call does it."""
    aux = self.hp_global_aux
    if not torch.is_grad_enabled() or aux.captured is not None:  # evaluation, generation; or nested
        return self.hp_forward_without_global_aux(*args, **kwargs)
    text = self.config.get_text_config()
    coef, config_coef = self.router_aux_loss_coef, getattr(text, "router_aux_loss_coef", None)
    self.router_aux_loss_coef = 0.0  # the loss without the rank's own term (TRL's fused head reads the config)
    if config_coef is not None:
        text.router_aux_loss_coef = 0.0
    aux.captured = []
    try:
        out = self.hp_forward_without_global_aux(*args, **kwargs)
        captured = aux.captured
    finally:
        self.router_aux_loss_coef, aux.captured = coef, None
        if config_coef is not None:
            text.router_aux_loss_coef = config_coef
    if getattr(out, "aux_loss", None) is None or not captured:
        raise ExpertParallelError(
            f"routing.aux_loss: global: {type(self).__name__}'s training forward computed no load-balancing loss; "
            "load the model with output_router_logits=True (TRL's trainers ask for it when router_aux_loss_coef is "
            "not 0) or set routing.aux_loss: micro_batch"
        )
    out.aux_loss = aux(tuple(captured), kwargs.get("attention_mask"))
    if out.loss is not None:
        out.loss = out.loss + coef * aux.loss_scale * out.aux_loss.to(out.loss.device)
    return out
