"""Experts-level archetype: only the experts call becomes expert-parallel.

Used when the block as a whole has no archetype (shared branch on the decoder layer, projections
around the experts, routed scaling in the block, several experts holders...). The model's own block
code, router and shared expert keep running; the experts holder's forward, which receives global
expert ids, dispatches the rows to the ranks that own their experts and combines the results.
"""

from hp_rewrite import runtime as hp


def forward(self, hidden_states, top_k_index=None, top_k_weights=None):
    if isinstance(hidden_states, hp.LocalBatch):  # called by a block-level forward: local experts only
        return hp.local_experts_forward(self, hidden_states, self.hp_layout)
    state = hp.dispatch(hidden_states, top_k_index, top_k_weights, binding=self.hp_expert_parallel)
    return hp.experts_and_combine(state, self, via_call=False)
