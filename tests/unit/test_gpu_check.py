"""The GPU check (`tests/gpu/check.py`), run here in its CPU mode: the same steps as on a GPU (the GPU tests'
CPU variants, bench_gpu's SFT and PPO update, bench_offload's page-locked moves) with tiny shapes, so that
a change that breaks the check, or a benchmark it runs, fails on a machine without a GPU."""

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tests" / "gpu" / "check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


# A minute of CPU: CI runs it after the default suite, with the benchmarks' slow CPU modes (.ci/run).
@pytest.mark.slow
def test_the_check_runs_every_step_on_the_cpu_and_sums_them_up(tmp_path):
    result = subprocess.run([sys.executable, "tests/gpu/check.py", "--device", "cpu", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    table = (tmp_path / "summary.txt").read_text()
    assert table in result.stdout
    rows = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^(\S+(?: \S+)?)\s{2,}"
                                                                r"(passed|failed.*?|timed out.*?)\s+\d+$",
                                                                table, re.MULTILINE)}
    assert rows == {"tests": "passed", "bench_gpu cpu": "passed", "bench_offload": "passed"}, table
    assert re.search(r"^    \d+ passed, \d+ skipped", table, re.MULTILINE)  # the GPU tests' CPU variants ran
    for workload in ("sft", "ppo"):  # both systems of both workloads, and their comparison
        assert re.search(rf"^    {workload}\s+RL2\s+\d", table, re.MULTILINE), table
        assert re.search(rf"^    {workload}\s+HF Trainer\s+\d", table, re.MULTILINE), table
        assert re.search(rf"^    {workload}\s+RL2: [\d.]+x HF Trainer's tokens/s", table, re.MULTILINE), table
    assert re.search(r"^    page-locked\s+\d", table, re.MULTILINE), table
    assert {p.name for p in tmp_path.iterdir()} == {"summary.txt", "tests.log", "bench_gpu_cpu.log",
                                                    "bench_offload.log", "profile_cpu"}
    for workload in ("sft", "ppo"):  # one RL2 step of each profiled: a table of operators and their times
        profile = (tmp_path / "profile_cpu" / f"rl2_{workload}.txt").read_text()
        assert re.search(r"Self CPU %.*# of Calls", profile) and "aten::" in profile


def test_a_failed_or_overrunning_step_is_named_in_the_table(tmp_path):
    never = re.compile(r"^$^")
    failing = check.Step("broken", [sys.executable, "-c", "print('half a table'); raise SystemExit(3)"], 30, never)
    slow = check.Step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 0.5, never)
    outcomes = [check.run_step(failing, tmp_path), check.run_step(slow, tmp_path)]
    assert [o.status for o in outcomes] == ["failed (exit 3)", "timed out after 0 s"]
    assert (tmp_path / "broken.log").read_text() == "half a table\n"
    table = check.summary(outcomes)
    assert re.search(r"^broken\s+failed \(exit 3\)", table, re.MULTILINE)
    assert re.search(r"^slow\s+timed out after 0 s", table, re.MULTILINE)


def test_missing_packages_without_wheels_stop_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setitem(check.WHEELS, "no_such_module_rl2", ["no-such-wheel==1.0"])
    try:
        check.install_missing(tmp_path / "absent")
    except SystemExit as stop:
        message = str(stop)
    else:
        raise AssertionError("install_missing went on without the wheels")
    assert "no-such-wheel==1.0" in message and "python tests/gpu/check.py --prepare" in message
