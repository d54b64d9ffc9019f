"""Experts-level archetype: only the experts call becomes expert-parallel.

Used when the block as a whole has no archetype (shared branch on the decoder layer, projections
around the experts, routed scaling in the block, several experts holders...). The model's own block
code, router and shared expert keep running; the experts holder's forward, which receives global
expert ids, dispatches the rows to the ranks that own their experts and combines the results.

The forward itself is the runtime's (:func:`hp_rewrite.runtime.expert_parallel_forward`, the one
``install_expert_parallel`` installs): there is one experts-level forward, and the generated function
only gives it the patched class's name in the artifact.
"""

# ruff: noqa: F821 - the upper-case placeholder is declared by Params below, not as a global
from dataclasses import dataclass

from hp_rewrite import runtime as hp


@dataclass(frozen=True)
class Params:
    """The template's contract: every experts holder runs the same forward; ``EVAL_SCALE`` scales its
    output in eval mode (NLLB-MoE's experts multiply by ``1 - moe_token_dropout`` there)."""

    EVAL_SCALE: float = 1.0


def forward(self, hidden_states, top_k_index=None, top_k_weights=None):
    if EVAL_SCALE == 1.0:
        return hp.expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights)
    else:
        return hp.expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights, eval_scale=EVAL_SCALE)
