"""The environment variables that switch RL2's compiled and tuned code paths, read here and nowhere else.
Each is on unless set to "0"; docs/native.md has the table."""

import os
from pathlib import Path


def _switch(variable: str, path: str):
    """A function that says, at each call, whether `variable` leaves `path` on (any value but "0")."""

    def on() -> bool:
        return os.environ.get(variable, "1") != "0"

    on.__doc__ = f"{variable}: {path}."
    return on


fused_layers = _switch("RL2_FUSED_LAYERS", "the trainer's RMSNorm and SwiGLU activation as C passes on CPU")
prefix_attention = _switch("RL2_PREFIX_ATTENTION", "shared-prefix attention on CPU in C, else SDPA calls")
decode_kernels = _switch("RL2_DECODE_KERNELS", "the embedded engine's decode step in C, else torch ops")
keep_freed_memory = _switch("RL2_KEEP_FREED_MEMORY", "glibc malloc keeps freed memory in the process")
pinned_offload = _switch("RL2_PINNED_OFFLOAD", "a GPU worker's state offloads into page-locked, else pageable, memory")
shared_memory_collectives = _switch("RL2_SHARED_MEMORY_COLLECTIVES",
                                    "FSDP's collectives between CPU ranks on one host through /dev/shm, else gloo")
triton_logps = _switch("RL2_TRITON_LOGPS", "log-probabilities on CUDA in Triton, else chunked torch ops")


def march() -> str:
    """RL2_MARCH: the target gcc compiles the C libraries for (`-march`); default "native", this CPU."""
    return os.environ.get("RL2_MARCH", "native")


def cache_root() -> Path:
    """RL2_CACHE: where converted models and built C libraries live; default ~/.cache/rl2."""
    return Path(os.environ.get("RL2_CACHE", Path.home() / ".cache" / "rl2"))
