"""How long each phase of a training step takes, the most resident memory (RSS) this process held during it
and, on a GPU, the most its tensors held (`torch.cuda.max_memory_allocated`; not a colocated SGLang server's).
The RSS peak is the kernel's high-water mark, reset at the start of the phase (`/proc/self/clear_refs`, Linux 4.0
and later; elsewhere each phase reports the peak so far). A reset also lowers `getrusage`'s `ru_maxrss`: measure
a whole run from outside, as `benchmarks/bench_ppo_w1.py` does."""

import contextlib
import resource
import sys
import time

import torch
import torch.distributed as dist


def reset_peak_rss() -> None:
    """Start a new high-water mark of this process's RSS (a no-op where the kernel cannot)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_gb() -> float:
    """The high-water mark of this process's RSS since the last reset (or since it started), in GB."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024 / 1e9
    except (OSError, StopIteration):
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, kB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


# The key ending of a phase's GPU peak (`perf/{phase}_gpu_peak_gb`), beside its RSS peak (`perf/{phase}_peak_gb`).
GPU_PEAK = "_gpu_peak_gb"


@contextlib.contextmanager
def measured(metrics: dict, phase: str):
    """Record `perf/{phase}_s` (seconds) and `perf/{phase}_peak_gb` (this rank's peak RSS) of the block and,
    once this process uses CUDA, `perf/{phase}_gpu_peak_gb` (the peak of its tensors on its current GPU)."""
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    began = time.perf_counter()
    yield
    metrics[f"perf/{phase}_s"] = time.perf_counter() - began
    metrics[f"perf/{phase}_peak_gb"] = peak_rss_gb()
    if gpu:
        metrics[f"perf/{phase}{GPU_PEAK}"] = torch.cuda.max_memory_allocated() / 1e9


def max_over_ranks(metrics: dict, device: torch.device) -> None:
    """Replace each `*_peak_gb` metric by its maximum over all ranks, in place, and add `perf/peak_gb`, the
    largest RSS peak, and, where GPU peaks were measured, `perf/gpu_peak_gb`, the largest of those: the
    memory the busiest rank needed. Collective: every rank must have measured the same phases."""
    keys = sorted(key for key in metrics if key.endswith("_peak_gb"))
    if not keys:
        return
    values = torch.tensor([metrics[key] for key in keys], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    metrics.update(zip(keys, values.tolist(), strict=True))
    for total, on_gpu in (("perf/peak_gb", False), ("perf/gpu_peak_gb", True)):
        peaks = [metrics[key] for key in keys if key.endswith(GPU_PEAK) == on_gpu]
        if peaks:
            metrics[total] = max(peaks)
