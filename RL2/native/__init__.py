"""RL2's compiled and hardware-tuned code: it changes how fast and in how much memory, never what RL2 computes.
The rest of RL2 reaches it through the hooks below, each a no-op where it does not apply (the embedded engine also
through its kernels and allocator); docs/native.md has the files, hooks and switches."""

import os

import torch

from RL2.native import switches
from RL2.native.allocator import keep_freed_memory
from RL2.native.fused_layers import install_fused_layers
from RL2.native.host_memory import check_model_fits_host
from RL2.native.pinned_host import PinnedHostCopies, state_to_host
from RL2.native.shared_memory_collectives import SharedMemoryCollectives
from RL2.native.shared_memory_gather import SharedMemoryGather
from RL2.native.tied_embeddings import add_embedding_rows_into_tied_gradient

__all__ = ["PinnedHostCopies", "SharedMemoryGather", "check_fits_host", "pinned_offload", "prepare_process",
           "share_fsdp_buffers", "shared_weight_gather", "state_to_host", "tune_model", "use_huge_pages"]


def prepare_process(device: torch.device) -> None:
    """Huge pages, and on CPU malloc keeping freed memory (tensors of the same sizes come and go every step).
    At the start of a run: before torch's first CPU allocation and before any thread that allocates."""
    use_huge_pages()
    if device.type == "cpu":
        keep_freed_memory()


def use_huge_pages() -> None:
    """Torch's large CPU tensors on huge pages, here and in children; before torch's first CPU allocation."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def check_fits_host(model: torch.nn.Module, device: torch.device, name: str, trained: bool,
                    param_dtype: torch.dtype, shards: int) -> None:
    """On CPU, `host_memory.check_model_fits_host`: raise before loading a model that cannot fit this host."""
    if device.type == "cpu":
        check_model_fits_host(model, name, trained, param_dtype, shards)


def tune_model(model: torch.nn.Module, device: torch.device, sparse_tied_embedding: bool) -> None:
    """On CPU, before sharding: the fused layers, and the tied embedding's sparse gradient if asked."""
    if device.type != "cpu":
        return
    install_fused_layers(model)
    if sparse_tied_embedding:
        add_embedding_rows_into_tied_gradient(model)


def share_fsdp_buffers(model: torch.nn.Module, mesh, device: torch.device) -> None:
    """On CPU with a one-dimensional mesh, `model`'s FSDP collectives through shared memory. Collective."""
    if device.type != "cpu" or mesh.ndim != 1:
        return
    collectives = SharedMemoryCollectives.for_group(mesh.get_group())
    if collectives is not None:
        collectives.attach(model)


def shared_weight_gather(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> SharedMemoryGather | None:
    """On CPU, `SharedMemoryGather.build`; None where that does not apply. Collective."""
    return SharedMemoryGather.build(model, dtype) if device.type == "cpu" else None


def pinned_offload(source: torch.device, target: torch.device) -> bool:
    """Whether state moved from `source` to `target` goes into page-locked buffers: CUDA to CPU, if switched on."""
    return source.type == "cuda" and target.type == "cpu" and switches.pinned_offload()
