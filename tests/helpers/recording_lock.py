"""A test double for page-locking: records the address ranges `cudaHostRegister` would lock."""

import torch

from RL2.native.pinned_host import PAGE


class RecordingLock:
    """Records lock and unlock calls in place of cudaHostRegister / cudaHostUnregister."""

    def __init__(self, fail_at: int | None = None):
        self.locked: dict[int, int] = {}  # address -> bytes, while locked
        self.calls = 0
        self.fail_at = fail_at  # the lock call that fails, as cudaHostRegister does when the host is full

    def lock(self, address: int, nbytes: int) -> None:
        if self.calls + 1 == self.fail_at:
            raise RuntimeError("could not page-lock (recorded failure)")
        assert address % PAGE == 0 and nbytes % PAGE == 0, "whole pages"
        for other, size in self.locked.items():
            assert address + nbytes <= other or other + size <= address, "a page locked twice"
        self.locked[address] = nbytes
        self.calls += 1

    def unlock(self, address: int) -> None:
        del self.locked[address]

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is page-locked as CUDA would see it: its bytes in one locked range, and so is the
        first byte of its storage, which is what `Tensor.is_pinned` asks CUDA about."""
        base = tensor.untyped_storage().data_ptr()
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        return any(a <= base and a <= start and end <= a + n for a, n in self.locked.items())
