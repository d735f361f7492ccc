"""What the benchmarks share: the matmul peak they compare against, and launching a worker on N ranks."""

import json
import os
import subprocess
import sys
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
