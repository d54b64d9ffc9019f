"""Gradient synchronisation, between the runtime and the engines: the EP x DP gradient contract, grad norms that count rank-local experts once, the engine guard, lockstep generation."""
