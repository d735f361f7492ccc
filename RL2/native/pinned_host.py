"""Page-locked host buffers for a worker's state while a colocated engine has the GPU (docs/gpus.md): each tensor
gets a buffer of exactly its size, page-locked once with `cudaHostRegister` and refilled at every offload, where
torch's pinned allocator would round each block up to a power of two and keep it."""

import mmap
import weakref
from collections.abc import Callable, Hashable, Iterable

import torch
from torch.distributed.tensor import DTensor

from RL2.parallel import shard_of

PAGE = mmap.PAGESIZE
SMALL_BYTES = 2**20  # smaller tensors (norms, biases, step counts) are copied to pageable memory: as fast


class PinnedHostCopies:
    """Host copies of device tensors, one page-locked buffer per key, reused at every offload. `lock(address, nbytes)`
    page-locks, raising where it cannot; `unlock(address)` undoes it (`cudaHostRegister`, `cudaHostUnregister`)."""

    def __init__(self, lock: Callable[[int, int], None] | None = None, unlock: Callable[[int], None] | None = None):
        self.lock, self.unlock = lock or cuda_host_register, unlock or cuda_host_unregister
        self.buffers: dict[Hashable, torch.Tensor] = {}
        self.registered: dict[Hashable, int] = {}  # key -> the page-locked address of its buffer
        # Unlocked when this object goes; the buffers stay valid, as pageable memory, for anyone still holding them.
        weakref.finalize(self, _unlock_all, self.unlock, self.registered, self.buffers)

    def reserve(self, tensors: Iterable[tuple[Hashable, torch.Tensor]]) -> None:
        """Lock the buffers of every `(key, tensor)` a move will copy before it copies any: a host that
        cannot lock them all fails with the state still where it was."""
        for key, tensor in tensors:
            local = shard_of(tensor)
            if takes_buffer(local) and not self._fits(key, local):
                self._allocate(key, local)

    def copy(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, from the GPU, in the host buffer kept for `key`; a DTensor keeps its placement."""
        local = shard_of(tensor)
        if takes_buffer(local):
            host = self.buffers[key] if self._fits(key, local) else self._allocate(key, local)
            host.copy_(local)  # blocking: nothing reads a half-copied buffer
        else:
            host = local.to("cpu")
        if isinstance(tensor, DTensor):
            # As FSDP2 builds its sharded parameters: `DTensor.from_local` would move the buffer to the mesh's device.
            return DTensor(host, tensor._spec, requires_grad=False)
        return host

    def _fits(self, key: Hashable, local: torch.Tensor) -> bool:
        host = self.buffers.get(key)
        return host is not None and host.shape == local.shape and host.dtype == local.dtype

    def _allocate(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        if key in self.registered:
            self.unlock(self.registered.pop(key))
        nbytes = like.numel() * like.element_size()
        # Whole pages of its own (an anonymous mapping): no page locked twice by two neighbouring buffers, and a
        # storage that starts where the locked range does, as torch asks CUDA about a storage's first byte
        # (`Tensor.is_pinned`, and the copies that choose their path by it).
        locked = -(-nbytes // PAGE) * PAGE
        pages = torch.frombuffer(mmap.mmap(-1, locked), dtype=torch.uint8)
        self.lock(pages.data_ptr(), locked)
        self.registered[key] = pages.data_ptr()
        self.buffers[key] = pages[:nbytes].view(like.dtype).view(like.shape)
        return self.buffers[key]


def takes_buffer(local: torch.Tensor) -> bool:
    """Whether a tensor is copied into a locked buffer: not a small one (pageable memory is as fast), nor a view into
    a larger storage (FSDP2 copies an uneven shard into fresh padded memory at every move: a second copy)."""
    nbytes = local.numel() * local.element_size()
    return nbytes >= SMALL_BYTES and local.untyped_storage().nbytes() == nbytes


def state_to_host(copies: PinnedHostCopies, module: torch.nn.Module | None = None,
                  optimizer: torch.optim.Optimizer | None = None) -> None:
    """Move `module`'s parameters and `optimizer`'s state into `copies` (gradients, buffers: pageable). FSDP2's `_apply`
    re-points each sharded parameter at its host copy: parameters keep their identity and the optimizer's references."""
    # Keys that outlive a move: a parameter's id (it keeps its identity), an optimizer state's (param id, name).
    params = list(module.parameters()) if module is not None else []
    slots = [(param, name) for param, state in optimizer.state.items() for name, value in state.items()
             if torch.is_tensor(value)] if optimizer is not None else []
    copies.reserve([(("param", id(p)), p) for p in params]
                   + [((id(param), name), optimizer.state[param][name]) for param, name in slots])

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, torch.nn.Parameter):
            return copies.copy(("param", id(tensor)), tensor)
        return tensor.to("cpu")  # a gradient or a module buffer

    if module is not None:
        module._apply(to_host)
    for param, name in slots:
        optimizer.state[param][name] = copies.copy((id(param), name), optimizer.state[param][name])


def cuda_host_register(address: int, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(address, nbytes, 0)
    if error != cudart.cudaError.success:
        raise RuntimeError(f"could not page-lock {nbytes / 2**20:.0f} MiB of host memory for offloaded state "
                           f"({cudart.cudaGetErrorString(error)}); set RL2_PINNED_OFFLOAD=0 to offload into "
                           "pageable memory (slower copies, swappable)")


def cuda_host_unregister(address: int) -> None:
    # Its error, if any, needs no handling: the buffer is given up either way (at exit CUDA may be gone).
    torch.cuda.cudart().cudaHostUnregister(address)


def _unlock_all(unlock: Callable[[int], None], registered: dict[Hashable, int],
                buffers: dict[Hashable, torch.Tensor]) -> None:
    for address in registered.values():
        unlock(address)
    registered.clear()
    buffers.clear()
