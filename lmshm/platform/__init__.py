"""Device-specific wrapping of tensors for inter-process sharing. Knows nothing of sockets."""
