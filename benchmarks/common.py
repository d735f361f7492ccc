"""What the benchmarks share: the matmul peak they compare against, and launching a worker on N ranks."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a square matmul with every core (what a training step could hope for)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    began = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - began)


def run_worker(script: str, nproc: int, flags: list[str]) -> dict:
    """Run `script --worker FLAGS` on `nproc` ranks (the cores split between them); returns the JSON
    object the worker prints last."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script, "--worker", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(max(1, os.cpu_count() // nproc))}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of the given (possibly distributed) tensors."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (Linux /proc)."""
    pids, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        pids.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    frontier += [int(child) for child in f.read().split()]
        except OSError:
            pass  # it has just exited
    return pids


def proportional_set_size(pid: int) -> int:
    """Bytes of memory a process holds, pages it shares with others (/dev/shm, libraries) divided among
    them: summed over the ranks, memory they share counts once."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
    except (OSError, StopIteration):
        return 0


class PeakMemory:
    """The most memory a process tree (a launcher and its ranks) held at once, sampled every `interval` s.

        with PeakMemory(process.pid) as memory:
            process.wait()
        memory.peak_gb
    """

    def __init__(self, root: int, interval: float = 0.1):
        self.root, self.interval, self.peak_bytes = root, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, sum(proportional_set_size(p) for p in process_tree(self.root)))
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / 1e9


def run_measured(command: list[str], env: dict | None = None, cwd: Path = REPO) -> float:
    """Run a command to its end (raising if it fails); the most memory (GB) its process tree held at once."""
    process = subprocess.Popen(command, cwd=cwd, env=os.environ | (env or {}))
    with PeakMemory(process.pid) as memory:
        if process.wait():
            raise subprocess.CalledProcessError(process.returncode, command)
    return memory.peak_gb
