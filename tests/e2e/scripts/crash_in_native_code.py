"""Two ranks: rank 1 dies of a segmentation fault inside native code while rank 0 waits for it in an
all-reduce. tests/e2e/test_crash_report.py checks that the dead rank names where it was.

    torchrun --nproc_per_node=2 tests/e2e/scripts/crash_in_native_code.py
"""

import ctypes
import resource

import torch
import torch.distributed as dist

from RL2.parallel import init_distributed


def read_address_zero() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the repository, wherever cores are on
    ctypes.string_at(0)  # a native read of an unmapped address: SIGSEGV


def main() -> None:
    init_distributed(torch.device("cpu"))
    if dist.get_rank() == 1:
        read_address_zero()
    dist.all_reduce(torch.ones(1))


if __name__ == "__main__":
    main()
