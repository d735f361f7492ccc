"""Every benchmark script runs, in a tiny CPU mode, where CI runs it: a benchmark that breaks fails CI.

Each case runs the script with the smallest flags that still go through its real code path and checks that
it exits 0 and prints a row of its table with figures. The quick ones run in the default suite; the ones
that start several trainers or torchrun jobs (a minute or more each) are marked slow and run as a step of
their own in `.ci/run`. A few scripts are run by other tests, named in ELSEWHERE; a new script with no case
fails `test_every_benchmark_is_run_somewhere`.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

BENCHMARKS = REPO / "benchmarks"

# script: (flags, a line of its table with figures)
QUICK = {
    "bench_decode_attention.py": (["--rows", "2", "--lengths", "8", "--steps", "2"], r"^\|.*\d"),
    "bench_fused_layers.py": (["--tokens", "64", "--layers", "1", "--repeats", "1"], r"^\|.*\d"),
    "bench_logps.py": (["--tokens", "64", "--vocab", "1000", "--repeats", "1"], r"^\|.*\d"),
    "bench_prefix_attention.py": (["--groups", "1", "--prompt", "8", "--responses", "2", "--response", "8",
                                   "--repeats", "1"], r"^float32\s+prefix_attention\.c\s+[\d.]+"),
    "bench_engine.py": (["--repeats", "1", "--requests", "2", "--new-tokens", "4"],
                        r"^embedded engine tokens/s\s+\|\s+[\d.]+"),
    "bench_ppo_memory.py": (["--models", "135m", "--rollouts", "2x2x8", "--ranks", "1"],
                            r"^\| 135m \| 2x2x8 \| 1 \| [\d.]+ \|"),
}
SLOW = {
    "bench_decode_linears.py": (["--rows", "2", "--steps", "2"], r"^\| 2 \|.*\| [\d.]+ \|"),
    "bench_parallel_memory.py": (["--mem-seq-len", "8", "--cp-seq-len", "32", "--steps", "1"],
                                 r"^\| cp=2 \| 2 \| [\d.]+"),
    "bench_sft.py": (["--steps", "1", "--seqs", "2", "--seq-len", "16"], r"^float32\s+2\s+[\d.]+"),
    "bench_lora.py": (["--rank", "4", "--seq-len", "8", "--seqs", "1", "--steps", "1"], r"^\| LoRA r=4 \|.*\d"),
    "bench_async.py": (["--steps", "2", "--etas", "1", "--prompts", "2", "--responses", "2", "--new-tokens", "4",
                        "--test-prompts", "2", "--nproc", "1", "--over-sampling", "1"], r"^\|.*\d"),
    "bench_ppo_w1.py": (["--steps", "2", "--skip-trl", "--nproc", "1"], r"^\|.*\d"),
}
# Run by other tests, each with its own checks of the output.
ELSEWHERE = {
    "bench_gpu.py": "tests/unit/test_gpu_check.py (the GPU check's CPU mode)",
    "bench_offload.py": "tests/unit/test_gpu_check.py (the GPU check's CPU mode)",
    "bench_agent_endpoint.py": "tests/unit/test_benchmark_scripts.py::test_agent_endpoint_bench_samples_the_same_tokens_both_ways",
    "bench_sglang_cpu.py": "tests/unit/test_benchmark_scripts.py (with the SGLang environment)",
    "step_files.py": "test_step_files_traces_a_grpo_step (below)",
}


def run(script: str, *flags: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check_table(script: str, flags: list[str], row: str) -> None:
    result = run(script, *flags)
    assert result.returncode == 0, f"{script} {' '.join(flags)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert re.search(row, result.stdout, re.MULTILINE), f"{script}: no row like {row!r} in\n{result.stdout[-3000:]}"
    assert not re.search(r"\bfailed\b", result.stdout), result.stdout[-3000:]


def test_every_benchmark_is_run_somewhere():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - {"common.py"}
    assert scripts == set(QUICK) | set(SLOW) | set(ELSEWHERE)


@pytest.mark.parametrize("script", sorted(QUICK))
def test_a_quick_benchmark_prints_its_table(script):
    check_table(script, *QUICK[script])


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SLOW))
def test_a_long_benchmark_prints_its_table(script):
    check_table(script, *SLOW[script])


@pytest.mark.slow
def test_step_files_traces_a_grpo_step(tmp_path):
    data = subprocess.run([sys.executable, "examples/data/make_arithmetic.py", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert data.returncode == 0, data.stderr[-2000:]
    result = run("step_files.py", "--train", str(tmp_path / "rl_train.jsonl"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"RL2/trainer/ppo\.py", result.stdout), result.stdout[-3000:]
