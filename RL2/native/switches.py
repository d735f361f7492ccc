"""The environment variables that switch RL2's compiled and tuned code paths, read here and nowhere else.
Each is on unless set to "0"; docs/native.md has the table."""

import os
from pathlib import Path


def _on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def fused_layers() -> bool:
    """RL2_FUSED_LAYERS: the trainer's RMSNorm and SwiGLU activation as C passes (`fused_layers.c`) on CPU."""
    return _on("RL2_FUSED_LAYERS")


def prefix_attention() -> bool:
    """RL2_PREFIX_ATTENTION: shared-prefix attention on CPU in C (`prefix_attention.c`), else SDPA calls."""
    return _on("RL2_PREFIX_ATTENTION")


def decode_kernels() -> bool:
    """RL2_DECODE_KERNELS: the embedded engine's decode step in C (`decode_kernels.c`), else torch ops."""
    return _on("RL2_DECODE_KERNELS")


def keep_freed_memory() -> bool:
    """RL2_KEEP_FREED_MEMORY: glibc malloc keeps freed memory in the process (`allocator.py`)."""
    return _on("RL2_KEEP_FREED_MEMORY")


def pinned_offload() -> bool:
    """RL2_PINNED_OFFLOAD: a GPU worker's state offloads into page-locked (`pinned_host.py`), else pageable, memory."""
    return _on("RL2_PINNED_OFFLOAD")


def shared_memory_collectives() -> bool:
    """RL2_SHARED_MEMORY_COLLECTIVES: FSDP's collectives between CPU ranks on one host through /dev/shm, else gloo."""
    return _on("RL2_SHARED_MEMORY_COLLECTIVES")


def triton_logps() -> bool:
    """RL2_TRITON_LOGPS: log-probabilities on CUDA in Triton (`RL2.models.triton_logps`), else chunked torch ops."""
    return _on("RL2_TRITON_LOGPS")


def march() -> str:
    """RL2_MARCH: the target gcc compiles the C libraries for (`-march`); default "native", this CPU."""
    return os.environ.get("RL2_MARCH", "native")


def cache_root() -> Path:
    """RL2_CACHE: where converted models and built C libraries live; default ~/.cache/rl2."""
    return Path(os.environ.get("RL2_CACHE", Path.home() / ".cache" / "rl2"))
