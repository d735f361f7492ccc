"""The GPU check: every GPU test and the GPU benchmarks in one command, with one summary table.

Prepare, on a machine with the network (from the repository root):

    python tests/gpu/check.py --prepare gpu-check

writes into `gpu-check/` the wheels of what a bare GPU image lacks (omegaconf and its parser runtime,
datasets, dill, multiprocess: pure Python, ~1.5 MB) and the test tokenizer (~3.5 MB). Copy the repository
with that folder to the GPU machine (no network needed there) and run, from the repository root:

    python tests/gpu/check.py [--assets gpu-check] [--out gpu-check-results]

It installs what is missing from the wheels (`pip --no-index`), then runs, each step with its own time limit
(about 8 minutes in all on one H200):
- tests: `pytest tests/gpu tests/unit/test_triton_logps.py tests/unit/test_memory_metrics.py`;
- bench_gpu 0.5B and 1.5B: SFT and the PPO update against Hugging Face's Trainer (`--steps 3`), with one RL2
  step of each profiled into `--out`'s `profile_<size>/` (where the time goes when a figure falls short);
- bench_offload: page-locked against pageable offload at 0.5B.
Each step's output goes to `--out`; the table gives each step's result, seconds and key figures, and the
exit status is 1 when a step failed. `--device cpu` runs the same steps on the CPU with tiny shapes (the
GPU tests' CPU variants, the benchmarks' CPU modes): a check of this script that the CPU suite runs
(tests/unit/test_gpu_check.py).
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a bare GPU image lacks for the GPU tests (module: the wheels that provide it); its torch,
# transformers, Triton, accelerate, safetensors, pyarrow and pytest are there.
WHEELS = {"omegaconf": ["omegaconf==2.4.0", "antlr4-python3-runtime==4.13.2"],
          "datasets": ["datasets", "dill", "multiprocess"]}
GPU_TESTS = ["tests/gpu", "tests/unit/test_triton_logps.py", "tests/unit/test_memory_metrics.py"]


@dataclass
class Step:
    name: str
    command: list[str]
    timeout: float
    # Lines of the output worth a place in the summary (figures, comparisons, the test count).
    figures: re.Pattern
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    step: Step
    status: str  # "passed", "failed (exit N)", "timed out after N s"
    seconds: float
    figures: list[str]


def steps(device: str, tokenizer: str | None, out: Path) -> list[Step]:
    """The check's steps on `device`: at full size on CUDA, tiny shapes on the CPU. bench_gpu profiles one RL2
    step of each workload into `out/profile_<size>/`."""
    python = sys.executable
    tests_env = {"RL2_TEST_TOKENIZER": tokenizer} if tokenizer else {}
    test_count = re.compile(r"^=*\s*\d+ (passed|failed).*$|^\d+ (passed|failed).*$")
    gpu_figures = re.compile(r"^(workload\s+system|(sft|ppo)\s+(RL2|HF Trainer))\b.*$")
    offload_figures = re.compile(r"^(host memory|page-locked|pageable|4 KB pages)\b.*$")
    if device == "cpu":
        bench_gpu = {"cpu": ["--device", "cpu", "--seqs", "8", "--min-len", "16", "--max-len", "32", "--steps", "1",
                             "--hf-batch", "4"]}
        bench_offload = ["--device", "cpu", "--rounds", "2"]
        limits = (300, 300, 300)
    else:
        bench_gpu = {size: ["--size", size, "--steps", "3"] for size in ("0.5B", "1.5B")}
        bench_offload = ["--size", "0.5B", "--rounds", "4"]
        limits = (210, 120, 75)
    return [
        Step("tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s", *GPU_TESTS], limits[0],
             test_count, tests_env),
        *(Step(f"bench_gpu {size}", [python, "benchmarks/bench_gpu.py", *flags, f"--profile={out / f'profile_{size}'}"],
               limits[1], gpu_figures) for size, flags in bench_gpu.items()),
        Step("bench_offload", [python, "benchmarks/bench_offload.py", *bench_offload], limits[2], offload_figures),
    ]


def run_step(step: Step, out: Path) -> Outcome:
    """Run one step from the repository root, its output in `out/<name>.log`."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **step.env}
    log = out / f"{step.name.replace(' ', '_')}.log"
    began = time.perf_counter()
    print(f"[check] {step.name}: {' '.join(step.command[1:])}", flush=True)
    with log.open("w") as sink:
        try:
            code = subprocess.run(step.command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                  timeout=step.timeout).returncode
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {step.timeout:.0f} s"
    seconds = time.perf_counter() - began
    return Outcome(step, status, seconds, figure_lines(log.read_text(errors="replace"), step.figures))


def figure_lines(output: str, pattern: re.Pattern) -> list[str]:
    """The lines of a step's output that `pattern` picks, stripped of pytest's `=` rulers."""
    return [line.strip("= ").strip() for line in output.splitlines() if pattern.match(line.strip())]


def summary(outcomes: list[Outcome]) -> str:
    """One table: each step's result and seconds, then its figures under it."""
    lines = [f"{'step':<16}{'result':<26}{'seconds':>8}", "-" * 50]
    for o in outcomes:
        lines.append(f"{o.step.name:<16}{o.status:<26}{o.seconds:>8.0f}")
        lines += [f"    {figure}" for figure in o.figures]
    return "\n".join(lines)


def install_missing(assets: Path) -> None:
    """Install, from the wheels in `assets` and without the network, the packages whose modules are missing."""
    missing = [wheel for module, wheels in WHEELS.items() if importlib.util.find_spec(module) is None
               for wheel in wheels]
    if not missing:
        return
    if not assets.is_dir():
        sys.exit(f"{', '.join(missing)} are not installed and {assets} has no wheels: run "
                 f"`python tests/gpu/check.py --prepare {assets}` where the network is, and copy the folder here")
    print(f"[check] installing from {assets}: {', '.join(missing)}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links",
                    str(assets), *missing], check=True)


def prepare(assets: Path) -> None:
    """Wheels for a bare GPU image's Python (3.12 by default, `RL2_GPU_PYTHON_VERSION`) and the tokenizer."""
    assets.mkdir(parents=True, exist_ok=True)
    version = os.environ.get("RL2_GPU_PYTHON_VERSION", "3.12")
    wheels = [wheel for group in WHEELS.values() for wheel in group]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", version, "-d", str(assets), *wheels], check=True)
    sys.path.insert(0, str(REPO))
    from tests.helpers.tiny import tokenizer

    tokenizer().save_pretrained(assets / "tokenizer")
    print(f"{assets}: {sum(f.stat().st_size for f in assets.rglob('*') if f.is_file()) / 2**20:.1f} MiB; copy it "
          f"beside the repository on the GPU machine and run `python tests/gpu/check.py --assets {assets}`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", metavar="DIR", help="write the wheels and the tokenizer into DIR, and stop")
    parser.add_argument("--assets", default="gpu-check", help="the folder --prepare wrote")
    parser.add_argument("--out", default="gpu-check-results", help="where each step's output goes")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the same steps with tiny shapes, a check of this script")
    args = parser.parse_args()
    if args.prepare:
        prepare(Path(args.prepare))
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("the GPU check needs a CUDA GPU (--device cpu checks the script on the CPU)")
        print(f"[check] {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    assets, out = Path(args.assets), Path(args.out)
    if args.device == "cuda" or assets.is_dir():
        install_missing(assets)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = assets / "tokenizer"
    outcomes = [run_step(step, out)
                for step in steps(args.device, str(tokenizer) if tokenizer.is_dir() else None, out.resolve())]
    table = summary(outcomes)
    (out / "summary.txt").write_text(table + "\n")
    print(table)
    if any(o.status != "passed" for o in outcomes):
        sys.exit(1)


if __name__ == "__main__":
    main()
