"""Work beside the exchange: deferred expert weight gradients, micro-batches taking turns, a model's exchange runtime."""
