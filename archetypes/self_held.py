"""Block-level archetype for a block that holds its experts' weights itself (JetMoE's MoE).

The experts' 3-D weights live in two children of the block (``input_linear.weight``,
``output_linear.weight``), the router ``Linear`` inside a router module, and the block adds an output
bias after combining: router -> dispatch -> local experts and combine -> bias. The block is its own
experts holder, so the local experts are called directly (``via_call=False``).
"""

# ruff: noqa: F821 - the upper-case placeholders are declared by Params below, not as globals
from dataclasses import dataclass

import torch

from hp_rewrite import runtime as hp
from hp_rewrite.codegen.specialize import attribute


@dataclass(frozen=True)
class Params:
    """The template's contract: every placeholder of :func:`forward`, with its default."""

    ROUTER: str = attribute()  # the router Linear, a path below the block (router.layer)
    OUTPUT_BIAS: str | None = attribute(default=None)  # a [hidden] parameter added to the output
    TOP_K: int = 1
    RENORMALIZE: bool = True
    WEIGHTS_DTYPE: str = "logits"  # logits | fp32
    HAS_OUTPUT_BIAS: bool = False


def forward(self, hidden_states):
    shape = hidden_states.shape
    hidden = hidden_states.reshape(-1, shape[-1])
    logits = torch.nn.functional.linear(hidden, self.ROUTER.weight).float()
    routing = hp.softmax_topk(logits, TOP_K, renormalize=RENORMALIZE, weights_dtype=WEIGHTS_DTYPE)
    state = hp.dispatch(hidden, routing.indices, routing.weights.to(hidden.dtype), binding=hp.binding_of(self))
    out = hp.experts_and_combine(state, self, via_call=False)
    if HAS_OUTPUT_BIAS:
        out = out + self.OUTPUT_BIAS
    return out.reshape(shape)
