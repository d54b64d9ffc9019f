"""Block-level archetype: the whole MoE block forward, expert-parallel.

router -> dispatch (the count exchange) -> shared expert (queued before the one host read of the split
sizes; on a GPU on a side stream, overlapping the token exchange) -> local experts and combine ->
shared merge. The generator specialises this template per matched block class:
upper-case names are placeholders (attribute names of the block and constants, all declared by
:class:`Params`), and ``if`` tests on constants are resolved so only the branches the block has remain.
"""

# ruff: noqa: F821 - the upper-case placeholders are declared by Params below, not as globals
from dataclasses import dataclass

import torch

from hp_rewrite import runtime as hp
from hp_rewrite.codegen.specialize import attribute


@dataclass(frozen=True)
class Params:
    """The template's contract: every placeholder of :func:`forward`, with its default."""

    # attribute names on the block (self.ROUTER -> self.gate); None: the block has no such child
    ROUTER: str = attribute()
    EXPERTS: str = attribute()
    SHARED: str | None = attribute(default=None)
    SHARED_GATE: str | None = attribute(default=None)
    # constants, generated as literals
    ROUTER_KIND: str = "topk_router_module"  # softmax_topk | sigmoid_group | topk_router_module
    SHARED_MODE: str = "none"  # none | additive | gated | scaled
    RETURNS_ROUTER_WEIGHTS: bool = False
    TOP_K: int = 1
    RENORMALIZE: bool = False
    SCALING: float | None = None
    WEIGHTS_DTYPE: str = "logits"  # logits | fp32
    NUM_GROUPS: int = 1
    TOPK_GROUPS: int = 1
    MASKED_FILL: float = float("-inf")
    ROUTED_SCALE: float = 1.0
    BIAS_ON_BLOCK: bool = False  # sigmoid_group: e_score_correction_bias on the block, not on the router


def forward(self, hidden_states):
    shape = hidden_states.shape
    hidden = hidden_states.reshape(-1, shape[-1])
    if ROUTER_KIND == "softmax_topk":
        logits = torch.nn.functional.linear(hidden, self.ROUTER.weight)
        routing = hp.softmax_topk(
            logits, TOP_K, renormalize=RENORMALIZE, scaling=SCALING, weights_dtype=WEIGHTS_DTYPE
        )
    elif ROUTER_KIND == "sigmoid_group":
        if BIAS_ON_BLOCK:
            correction_bias = self.e_score_correction_bias
        else:
            correction_bias = self.ROUTER.e_score_correction_bias
        routing = hp.sigmoid_group(
            hidden,
            self.ROUTER.weight,
            correction_bias,
            TOP_K,
            num_groups=NUM_GROUPS,
            topk_groups=TOPK_GROUPS,
            renormalize=RENORMALIZE,
            scaling=SCALING,
            masked_fill=MASKED_FILL,
        )
    else:
        routing = hp.call_router_module(self.ROUTER, hidden)
    state = hp.dispatch(hidden, routing.indices, routing.weights, binding=hp.binding_of(self.EXPERTS))
    if SHARED_MODE != "none":
        shared = hp.shared_beside(state, self.SHARED, hidden)  # queued before the split-size read
    out = hp.experts_and_combine(state, self.EXPERTS)
    if SHARED_MODE == "gated":
        out = hp.merge_shared(out, shared, "gated", gate_logits=self.SHARED_GATE(hidden))
    elif SHARED_MODE == "scaled":
        out = hp.merge_shared(out, shared, "scaled", scale=ROUTED_SCALE)
    elif SHARED_MODE == "additive":
        out = hp.merge_shared(out, shared, "additive")
    if RETURNS_ROUTER_WEIGHTS:
        return out.reshape(shape), routing.weights
    else:
        return out.reshape(shape)
