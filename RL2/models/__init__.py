"""The model side of training: the default model, packed attention and log-probs, tensor/context/vocab parallelism."""
