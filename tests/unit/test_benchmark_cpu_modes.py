"""Every benchmark script runs, in a tiny CPU mode, where CI runs it: a benchmark that breaks fails CI.

Each case runs a script with the smallest flags that still go through its real code path (tiny shapes, one or
two steps or repeats) and checks that it exits 0 and prints its table: the header and a row with figures, no
row "failed" (bench_gpu and bench_ppo_memory print a failed arm's row, then exit 1 naming it). Every case starts
processes that import torch (several, for the timing scripts), from ten seconds each to several minutes for whole
trainer runs or an SGLang server, which the default suite cannot afford on every CPU kind: they are marked slow
and run as a step of their own in `.ci/run`. A script that another test already runs, with its own checks of the
table, is named in ELSEWHERE rather than run twice.
`test_every_benchmark_has_a_case` fails for a script in neither, so a new benchmark cannot be added unseen.
"""

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

BENCHMARKS = REPO / "benchmarks"
HELPERS = {"common.py"}  # imported by the scripts, not run
TINY_MODEL = "{tiny_model}"  # in flags: the tests' tiny random Llama (the `tiny_model_path` fixture)
RL_PROMPTS = "{rl_prompts}"  # in flags: examples/data/make_arithmetic.py's RL prompts


def case(script: str, flags: list[str], header: str, row: str, timeout: float):
    """A script's run: its flags, regular expressions of its table's header and of a row with figures, and
    the seconds it may take (a few times its run on a busy two-core machine); slow, as every case is."""
    return pytest.param(script, flags, header, row, timeout, marks=pytest.mark.slow, id=script)


CASES = [
    case("bench_decode_attention.py", ["--rows", "2", "--lengths", "8", "--steps", "2"],
         r"^\| rows \| length \| implementation \|", r"^\| 2 \| 8 \| decode_attention \(C\) \| [\d.]+ \|", 120),
    case("bench_fused_layers.py", ["--tokens", "64", "--layers", "1", "--repeats", "1"],
         r"^\| setting \| norms and activation \(ms\) \|", r"^\| fused \(default\) \| [\d.]+ \|", 120),
    case("bench_logps.py", ["--tokens", "64", "--vocab", "1000", "--repeats", "1"],
         r"^\| setting \| forward \(s\) \|", r"^\| chunked, 1 MB chunks \(default\) \| [\d.]+ \|", 120),
    case("bench_prefix_attention.py",
         ["--groups", "1", "--prompt", "8", "--responses", "2", "--response", "8", "--repeats", "1"],
         r"^dtype\s+path\s+forward ms", r"^float32\s+prefix_attention\.c\s+[\d.]+", 120),
    case("bench_engine.py", ["--repeats", "1", "--requests", "2", "--new-tokens", "4"],
         r"^2 requests x 4 new tokens", r"^embedded engine tokens/s\s+\| [\d.]+$", 180),
    # The tiny model: the same trainer runs, synchronous and asynchronous, for seconds instead of minutes.
    case("bench_async.py", ["--model", TINY_MODEL, "--steps", "2", "--etas", "1", "--prompts", "2", "--responses",
                            "2", "--new-tokens", "4", "--test-prompts", "2", "--long-questions", "2", "--nproc", "1",
                            "--over-sampling", "1"],
         r"^\| run \| step s \|", r"^\| async eta=1 \| [\d.]+ \|", 240),
    case("bench_ppo_memory.py", ["--models", "135m", "--rollouts", "1x2x2", "--ranks", "1"],
         r"^\| model \| rollout \| ranks \|", r"^\| 135m \| 1x2x2 \| 1 \| [\d.]+ \|", 300),
    # Two starts and two whole runs of a short SFT of the bundled model, each as RL2's command and from a program.
    case("bench_startup.py", ["--commands", "trainer.sft", "--run-steps", "1", "--repeats", "1"],
         r"^\| process \| as RL2's command s \|",
         r"^\| python -m RL2\.trainer\.sft, 1 step\(s\) of the bundled model, 1 rank \| [\d.]+ \| [\d.]+ \| [\d.]+ \| "
         r"[\d.]+ \| -?\d+% \|$", 300),
    # The viewer over a small made-up run: the same server and requests as 10,000 trajectories of 2k tokens.
    case("bench_viewer.py", ["--samples", "50", "--tokens", "16"], r"^\| request \| s \|",
         r"^\| open: index, status, curves, steps, first page \| [\d.]+ \|", 60),
    # The memory plan's formulas, on the meta device: no flags, the table of docs/gpus.md.
    case("memory_plan_table.py", [], r"^\| model \| GPUs \| server tp \|",
         r"^\| Qwen2\.5-7B \(7\.62B\) \| 8 \| 1 \| actor \| [\d.]+ GiB \|", 120),
    case("bench_sft.py", ["--dtype", "float32", "--steps", "1", "--seqs", "2", "--seq-len", "16"],
         r"^dtype\s+ranks\s+step s", r"^float32\s+2\s+[\d.]+", 400),
    case("bench_lora.py", ["--rank", "4", "--seq-len", "8", "--seqs", "1", "--steps", "1"],
         r"^\| mode \| ranks \|", r"^\| LoRA r=4 \| 2 \|.*\| [\d.]+ \|$", 600),
    case("bench_parallel_memory.py", ["--mem-seq-len", "8", "--cp-seq-len", "32", "--steps", "1"],
         r"^\| layout \| ranks \|", r"^\| cp=2 \| 2 \| [\d.]+ \|", 900),
    case("bench_ppo_w1.py", ["--steps", "2", "--skip-trl", "--nproc", "1"],
         r"^\| system \| s/step \|", r"^\| RL2 default \| [\d.]+ \|", 900),
    case("bench_decode_linears.py", ["--rows", "2", "--steps", "2"],
         r"^\| rows \| setting \| product \|", r"^\| 2 \| 1 process, 1 core \| panel_linear \| [\d.]+ \|", 400),
    case("bench_agent_tail.py", ["--tiny", "--prompts", "4", "--batch", "2", "--samples", "2", "--long-calls", "2",
                                 "--new-tokens", "4", "--repeats", "1"],
         r"^\| rollout s \| first 2 groups s \|", r"^\| [\d.]+ \| [\d.]+ \| \d+% \| 40 \|", 300),
    case("learning_per_minute.py", ["--model", TINY_MODEL, "--recipes", "default,exact-reward", "--steps", "2",
                                    "--test-freq", "1", "--nproc", "1"],
         r"^\| recipe \| s/step \|", r"^\| exact-reward \| [\d.]+ \| [\d.]+ \|", 600),
    case("step_files.py", ["--train", RL_PROMPTS], r"^RL path: \d+ files", r"^\s+\d+\s+RL2/trainer/ppo\.py$", 400),
]
# script: the test that runs it and checks its table ("file::function"), in the default suite or .ci/run's slow step.
ELSEWHERE = {
    # Its test also checks the ratio of the SGLang server's row to the embedded engine's.
    "bench_sglang_cpu.py":
        "tests/unit/test_benchmark_scripts.py::test_sglang_cpu_measures_the_embedded_engine_in_the_same_run",
    "bench_agent_endpoint.py":
        "tests/unit/test_benchmark_scripts.py::test_agent_endpoint_bench_samples_the_same_tokens_both_ways",
    # The GPU check's CPU mode runs `bench_gpu.py --device cpu` and checks both systems' rows of both workloads.
    "bench_gpu.py": "tests/unit/test_gpu_check.py::test_the_check_runs_every_step_on_the_cpu_and_sums_them_up",
    # ... and `bench_offload.py --device cpu`, checking its page-locked row.
    "bench_offload.py": "tests/unit/test_gpu_check.py::test_the_check_runs_every_step_on_the_cpu_and_sums_them_up",
    # Its table, as `main` prints it, must be the one in docs/agents.md.
    "chat_template_fidelity.py": "tests/unit/test_chat_template_fidelity.py::test_the_agents_page_has_the_table",
}


def run(script: str, flags: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *flags], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def rl_prompts(folder) -> str:
    made = subprocess.run([sys.executable, "examples/data/make_arithmetic.py", "--out", str(folder)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    return str(folder / "rl_train.jsonl")


def filled(flags: list[str], request, tmp_path) -> list[str]:
    """The flags with the files their placeholders stand for, made only for the case that names them."""
    makers = {TINY_MODEL: lambda: request.getfixturevalue("tiny_model_path"), RL_PROMPTS: lambda: rl_prompts(tmp_path)}
    return [makers[flag]() if flag in makers else flag for flag in flags]


@pytest.mark.parametrize("script, flags, header, row, timeout", CASES)
def test_a_benchmark_prints_its_table_in_its_tiny_cpu_mode(script, flags, header, row, timeout, request, tmp_path):
    result = run(script, filled(flags, request, tmp_path), timeout)
    said = f"{script} {' '.join(flags)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, said
    assert re.search(header, result.stdout, re.MULTILINE), f"no header like {header!r} in {said}"
    assert re.search(row, result.stdout, re.MULTILINE), f"no row like {row!r} in {said}"
    assert not re.search(r"\bfailed\b", result.stdout), said


# The command of .ci/run that runs slow tests after the default suite, its continued lines joined.
CI_SLOW_STEP = next(line for line in (REPO / ".ci" / "run").read_text().replace("\\\n", " ").splitlines()
                    if "-m slow" in line)


def referenced_test(reference: str) -> ast.FunctionDef | None:
    """The test function `file::function` names, parsed from its file; None where there is none."""
    path, name = reference.split("::")
    tree = ast.parse((REPO / path).read_text())
    return next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name), None)


def test_every_benchmark_has_a_case():
    """A script of benchmarks/ with neither a case nor a test CI runs (the default suite, or .ci/run's slow step)
    that runs it is one CI would not notice breaking."""
    scripts = {path.name for path in BENCHMARKS.glob("*.py")} - HELPERS
    cased = [param.values[0] for param in CASES]
    assert len(cased) == len(set(cased)), "a script with two cases"
    assert not set(cased) & set(ELSEWHERE), "a script run here and by another test"
    assert scripts - set(cased) - set(ELSEWHERE) == set(), "benchmarks with no case here nor in ELSEWHERE"
    assert set(cased) | set(ELSEWHERE) <= scripts, "a case for a script that is not there"
    for script, reference in ELSEWHERE.items():
        test = referenced_test(reference)
        assert test is not None, f"{script}: {reference} is not there"
        marks = " ".join(ast.unparse(decorator) for decorator in test.decorator_list)
        # A slow test runs in CI only where .ci/run's slow step names its file.
        assert "slow" not in marks or reference.split("::")[0] in CI_SLOW_STEP, \
            f"{script}: {reference} is marked slow, and .ci/run's slow step does not run its file"
        assert script.removesuffix(".py") in ast.unparse(test), f"{script}: {reference} does not run it"
