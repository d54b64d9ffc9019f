"""What generated code calls: dispatch -> local experts -> combine, capacity, zero experts, the input-scaled variant, the shared expert's merge."""
