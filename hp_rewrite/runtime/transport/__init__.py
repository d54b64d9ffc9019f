"""Moving rows between ranks: the all-to-all with autograd, fixed-order row gathers and sums, deduplication, the exchange protocol and its implementations."""
