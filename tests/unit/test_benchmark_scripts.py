"""The benchmark scripts' own checks and arithmetic: what they refuse before running, and how their
tables' figures are computed."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def run_script(name: str, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *flags], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_w1_refuses_a_single_step_before_running():
    """bench_ppo_w1's tables are medians of the steps after the first: `--steps 1` used to run the whole
    workload and then end in `StatisticsError: no median for empty data`."""
    result = run_script("bench_ppo_w1.py", "--steps", "1", "--skip-trl")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--steps 1: give at least 2" in result.stderr
