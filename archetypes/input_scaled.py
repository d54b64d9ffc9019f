"""Block-level archetype for experts that take no routing: the router score scales the experts' *input*.

Llama 4's block multiplies every token by its (sigmoid, top-k) router score before the experts and sums
the expert outputs with weight 1; its experts holder's ``forward(hidden)`` takes no routing. Here each
token goes to its selected experts as ``score * hidden`` (one row per (token, expert) slot, scaled on
the sending rank exactly as the original scales it), the experts run expert-parallel, and the slots
come back combined with weight 1. Experts the router did not select see a zero input in the original
and give zero (no biases), so they are left out. Placeholders as in ``block_routed.py``.
"""

# ruff: noqa: F821 - the upper-case placeholders are declared by Params below, not as globals
from dataclasses import dataclass

import torch

from hp_rewrite import runtime as hp
from hp_rewrite.codegen.specialize import attribute


@dataclass(frozen=True)
class Params:
    """The template's contract: every placeholder of :func:`forward`, with its default."""

    # attribute names on the block; the router module returns (scores [T, E], logits [T, E])
    ROUTER: str = attribute()
    EXPERTS: str = attribute()
    SHARED: str | None = attribute(default=None)
    # constants, generated as literals
    TOP_K: int = 1
    SHARED_MODE: str = "none"  # none | additive
    RETURNS_ROUTER_LOGITS: bool = False
    FLAT_OUTPUT: bool = False  # the block returns [T, H] rows (Llama 4), not the input's shape


def forward(self, hidden_states):
    shape = hidden_states.shape
    hidden = hidden_states.reshape(-1, shape[-1])
    scores, logits = self.ROUTER(hidden)
    indices = torch.topk(logits, TOP_K, dim=1).indices  # the router's own selection (same call, same ties)
    state = hp.dispatch_input_scaled(hidden, indices, scores.gather(1, indices), binding=hp.binding_of(self.EXPERTS))
    if SHARED_MODE != "none":
        shared = hp.shared_beside(state, self.SHARED, hidden)  # queued before the split-size read
    out = hp.combine_input_scaled(state, self.EXPERTS, TOP_K)
    if SHARED_MODE == "additive":
        out = hp.merge_shared(out, shared, "additive")
    if not FLAT_OUTPUT:
        out = out.reshape(shape)
    if RETURNS_ROUTER_LOGITS:
        return out, logits
    else:
        return out
