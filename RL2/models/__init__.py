"""The model side of training: the bundled default model, varlen attention over packed sequences,
log-probabilities and values of a packed micro-batch, and tensor/context/vocabulary parallelism."""
