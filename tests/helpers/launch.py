"""Run RL2 trainers (or test scripts) in fresh processes, under torchrun when more than one rank."""

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import REPO


def run_ranks(nproc: int, target: list[str], timeout: int = 300, device: str = "cpu") -> subprocess.CompletedProcess:
    """`target` is `["-m", "RL2.trainer.sft", ...]` or `[script.py, ...]`.

    With `device="cpu"` the ranks see no GPU, whatever the machine has: the end-to-end tests are the
    CPU suite (gloo ranks compared with one process), and on a machine with fewer GPUs than ranks
    `trainer.device=auto` would stop at start. The CUDA tests (tests/gpu) ask for `device="cuda"`.
    """
    # The repository first; a PYTHONPATH the caller set (packages installed beside the interpreter's) stays.
    if target[0] == "-m" and target[1].startswith("RL2.trainer.") and not any(
            arg.startswith("trainer.plot_learning_curve=") for arg in target):
        # The PNG costs a trainer ~1 s of matplotlib on a small CPU: drawn where a test checks it (it turns it on).
        target = [*target, "trainer.plot_learning_curve=false"]
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "WANDB_MODE": "disabled"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if nproc == 1:
        cmd = [sys.executable, *target]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--standalone", *target]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        crashes = "".join(f"{report}\n" for report in crash_reports(result.stderr))
        raise AssertionError(f"{' '.join(cmd)} failed:\n{crashes}{result.stdout[-3000:]}\n{result.stderr[-12000:]}")
    return result


def crash_reports(stderr: str, max_lines: int = 80) -> list[str]:
    """The stacks a rank killed by a signal printed (`RL2.parallel` turns Python's faulthandler on), with
    C++'s "terminate called ..." line before an abort's: first in a failure's message, where the tail of
    stderr would show only the peers' errors that followed."""
    lines, reports = stderr.splitlines(), []
    for at, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            first = at - 1 if at > 0 and lines[at - 1].startswith("terminate called") else at
            report = lines[first : first + max_lines]
            end = next((i for i, text in enumerate(report) if text.startswith("Extension modules")), len(report))
            reports.append("\n".join(report[:end]))
    return reports


def read_metrics(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(save_dir) / "metrics.jsonl").read_text().splitlines()]


@contextmanager
def separate_hosts(module, rank: int):
    """Inside, `module.socket.gethostname` names a host of each rank's own (as ranks on several machines see)."""
    real = module.socket.gethostname
    module.socket.gethostname = lambda: f"host-{rank}"
    try:
        yield
    finally:
        module.socket.gethostname = real
