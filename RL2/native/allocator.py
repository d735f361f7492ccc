"""Keep freed CPU memory in the process instead of returning it to the kernel (glibc malloc only).

glibc hands large blocks (from 128 KB, rising with use) to the kernel on free and trims the heap's top
as soon as it shrinks; the next tensor of that size then page-faults on every 4 KB page it touches, each
zeroed by the kernel. Training and decoding on CPU allocate tensors of the same few sizes over and over,
so this churn costs real time (`tests/e2e/test_allocator.py` counts the page faults); jemalloc and
tcmalloc, which torch's CPU launcher preloads for the same reason, cache freed memory too.

Blocks above 32 MB (glibc's cap on the mmap threshold: the tied embedding, its gradient, FSDP's buffers
of it) are kept too, by letting malloc map no block of its own. Mapping and unmapping them every step
cost more than their page faults: with two ranks on one machine, one rank's page zeroing held up the
other at every collective (`benchmarks/bench_ppo_w1.py`). Threads other than the main one still get
such blocks mapped, as glibc's per-thread heaps cannot hold them.

The price: the resident size stays at the heap's high-water mark, which creeps up over a run as freed
blocks are left in pieces too small for the next step's tensors (docs/cpu.md, "Memory on CPU").
"""

import ctypes
import ctypes.util

from RL2.native import switches

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_KEEP_BELOW_BYTES = 32 * 1024 * 1024  # the largest mmap threshold glibc accepts on 64-bit
_TRIM_ABOVE_BYTES = 2**31 - 1  # mallopt takes an int: a free heap top above 2 GB is still returned

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc once per process; False where the C library is not glibc or
    `RL2_KEEP_FREED_MEMORY=0` asks to leave it alone. Best called before the process starts threads that
    allocate (a process group's): glibc documents mallopt as unsafe beside them."""
    global _done
    if _done:
        return True
    if not switches.keep_freed_memory():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: other C libraries have no mallopt with these numbers
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, _KEEP_BELOW_BYTES), (_M_TRIM_THRESHOLD, _TRIM_ABOVE_BYTES), (_M_MMAP_MAX, 0))
    _done = all([bool(mallopt(parameter, value)) for parameter, value in settings])
    return _done
