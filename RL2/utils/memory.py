"""How long each phase of a training step takes, and the most resident memory (RSS) this process
held during it.

The peak of a phase is the kernel's high-water mark of the process's RSS, reset at the start of the
phase (`/proc/self/clear_refs`, Linux 4.0 and later). Elsewhere the mark cannot be reset and each
phase reports the process's peak so far. (A reset also lowers what `getrusage` reports as this
process's `ru_maxrss`: measure a whole run from outside, as `benchmarks/bench_ppo_w1.py` does.)
"""

import resource
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist


def reset_peak_rss() -> None:
    """Start a new high-water mark of this process's RSS (a no-op where the kernel cannot)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_gb() -> float:
    """The high-water mark of this process's RSS since the last reset (or since it started), in GB."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024 / 1e9
    except (OSError, StopIteration):
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, kB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


@contextmanager
def measured(metrics: dict, phase: str):
    """Record `perf/{phase}_s` (seconds) and `perf/{phase}_peak_gb` (this rank's peak RSS) of the block."""
    reset_peak_rss()
    began = time.perf_counter()
    yield
    metrics[f"perf/{phase}_s"] = time.perf_counter() - began
    metrics[f"perf/{phase}_peak_gb"] = peak_rss_gb()


def max_over_ranks(metrics: dict, device: torch.device, suffix: str = "_peak_gb") -> None:
    """Replace each metric whose key ends with `suffix` by its maximum over all ranks, in place, and add
    `perf/peak_gb`, the largest of them: the memory the busiest rank needed. Collective: every rank
    must have measured the same phases."""
    keys = sorted(key for key in metrics if key.endswith(suffix))
    if not keys:
        return
    values = torch.tensor([metrics[key] for key in keys], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    metrics.update(zip(keys, values.tolist(), strict=True))
    metrics["perf/peak_gb"] = max(values.tolist())
