"""Keep freed CPU memory in the process instead of returning it to the kernel (glibc malloc only): training
and decoding allocate tensors of the same few sizes over and over, and each fresh page faults and is zeroed.
docs/cpu.md ("Memory allocation", "Memory on CPU") has the why, the price and the figures."""

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
    """Tune glibc malloc once per process; False where the C library is not glibc or `RL2_KEEP_FREED_MEMORY=0`.
    Best called before the process starts threads that allocate (a process group's): mallopt is unsafe beside them."""
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
