"""Balancing the experts' rows over the EP group in training: which rows move (``decide``), the
transient copies of their experts' weights and the gradients back to the owner (``replicas``)."""
