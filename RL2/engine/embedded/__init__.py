"""The in-process engine: continuous batching over the model's own forward, float32 decode kernels
in C, SGLang's sampling and stop rules. `EmbeddedEngine` is in `engine.py`."""
