"""Learning per minute: held-out accuracy against training minutes for GRPO recipes on one-shot arithmetic.

    python benchmarks/learning_per_minute.py [--recipes default,example] [--steps 48] [--test-freq 4]
                                             [--model NAME] [--nproc 2]

The task is examples/grpo_smollm2.sh's: the embedded SmolLM2-135M-Instruct answers sums and differences of
small numbers, one worked example of the answer format in the prompt, 4 prompts a step. Every recipe runs
the same data, seed and step count; they differ only in the keys of RECIPES (learning rate, group size, std
normalisation, loss averaging, reward, dtype). Held-out accuracy is greedy on the 64 test prompts (an exact match
of the number in <answer></answer>), measured every --test-freq steps and not counted as training time.

Prints per recipe: seconds a step (the median), steps a minute, the accuracy before training, the best
accuracy and the training minutes to reach it, the training minutes to reach --target (90% unless given),
the accuracy at --budget minutes (4 unless given; the last evaluation within it) and the most memory all
of the run's processes held at once. Training minutes are the sum of the steps' own times
(`perf/step_s`): start-up and evaluations are left out, and shown apart as the run's wall time.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from common import run_measured  # noqa: E402

TASK = [
    "rollout.env_path=envs/arithmetic.py",
    "data.train.batch_size=4",
    "rollout.train_sampling_params.temperature=1.0",
    "rollout.train_sampling_params.max_new_tokens=32",
    "rollout.test_sampling_params.max_new_tokens=32",
    "rollout.test_sampling_params.temperature=0.0",
    "rollout.test_responses_per_prompt=1",
    "actor.dtype=auto",
    "actor.max_length_per_device=2048",
    "actor.max_grad_norm=1.0",
]
# name -> overrides on top of TASK; "default" is RL2's defaults (Dr. GRPO: no std division, token-level
# loss, group of 4, lr 1e-5), "example" examples/grpo_smollm2.sh's recipe.
RECIPES = {
    "default": [],
    "example": ["rollout.responses_per_prompt=8", "adv.norm_var=true"],
    "group-8": ["rollout.responses_per_prompt=8"],
    "lr-3e-5": ["actor.optimizer.lr=3e-5"],
    "lr-1e-4": ["actor.optimizer.lr=1e-4"],
    "group-8-lr-3e-5": ["rollout.responses_per_prompt=8", "actor.optimizer.lr=3e-5"],
    "batch-8-lr-3e-5": ["data.train.batch_size=8", "actor.optimizer.lr=3e-5"],
    "batch-8-lr-2e-5": ["data.train.batch_size=8", "actor.optimizer.lr=2e-5"],
    "batch-8-group-8-lr-3e-5": ["data.train.batch_size=8", "rollout.responses_per_prompt=8", "actor.optimizer.lr=3e-5"],
    "batch-8-lr-2e-5-cosine": ["data.train.batch_size=8", "actor.optimizer.lr=2e-5", "actor.scheduler.name=cosine"],
    "batch-16-lr-2e-5": ["data.train.batch_size=16", "actor.optimizer.lr=2e-5"],
    "std-norm": ["adv.norm_var=true"],
    "std-norm-lr-3e-5": ["adv.norm_var=true", "actor.optimizer.lr=3e-5"],
    "sequence-mean": ["actor.avg_level=sequence"],
    "exact-reward": ["rollout.env_path=benchmarks/envs/arithmetic_exact.py"],
    # The default recipe with the dtype fixed, whatever `auto` picks on this CPU: side by side, whether the
    # dtype alone changes learning.
    "bf16": ["actor.dtype=bfloat16"],
    "float32": ["actor.dtype=float32"],
}


def run_recipe(name: str, args, data: Path, out: Path) -> dict:
    save_dir = out / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "RL2.trainer.ppo", f"data.train.path={data / 'rl_train.jsonl'}",
               f"data.test.path={data / 'rl_test.jsonl'}", f"actor.model_name={args.model}", *TASK, *RECIPES[name],
               f"trainer.seed={args.seed}",
               f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
               f"trainer.save_dir={save_dir}", f"trainer.experiment_name={name}"]
    began = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        peak_gb = run_measured(command, stdout=log)
    wall_s = time.perf_counter() - began
    records = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"records": records, "peak_gb": peak_gb, "wall_s": wall_s}


def curve(records: list[dict]) -> tuple[list[float], list[tuple[float, float]]]:
    """The steps' own times, and (training minutes so far, held-out accuracy) at each evaluation."""
    step_s, points, minutes = [], [], 0.0
    for record in sorted(records, key=lambda r: r["step"]):
        if "perf/step_s" in record:
            step_s.append(record["perf/step_s"])
            minutes += record["perf/step_s"] / 60
        if "test/score" in record:
            points.append((minutes, record["test/score"]))
    return step_s, points


def summary(name: str, run: dict, target: float, budget: float) -> list[str]:
    step_s, points = curve(run["records"])
    best_minutes, best = max(points, key=lambda p: (p[1], -p[0]))
    reached = next((m for m, accuracy in points if accuracy >= target), None)
    within = [accuracy for m, accuracy in points if m <= budget]
    s_per_step = statistics.median(step_s[1:] or step_s)
    return [name, f"{s_per_step:.2f}", f"{60 / s_per_step:.1f}", f"{step_s[0]:.1f}", f"{points[0][1]:.0%}",
            f"{best:.0%} at {best_minutes:.1f}", "-" if reached is None else f"{reached:.1f}",
            f"{within[-1]:.0%}", f"{run['wall_s'] / 60:.1f}", f"{run['peak_gb']:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="bundled name or HF folder")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--test-freq", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy to reach")
    parser.add_argument("--budget", type=float, default=4.0, help="training minutes")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args()
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; choose from {list(RECIPES)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="rl2-learning-"))
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    subprocess.run([sys.executable, str(REPO / "examples/data/make_arithmetic.py"), "--out", str(data)], check=True,
                   stdout=subprocess.DEVNULL)
    header = ["recipe", "s/step", "steps/min", "first step s", "before", "best (at min)",
              f"min to {args.target:.0%}", f"at {args.budget:g} min", "wall min", "peak GB"]
    rows = []
    for name in names:
        rows.append(summary(name, run_recipe(name, args, data, out), args.target, args.budget))
        print(f"{name}: {rows[-1]}", flush=True)
    print(f"\n{args.steps} steps, held-out accuracy (greedy, 64 prompts) every {args.test_freq}; minutes are "
          f"training minutes (runs in {out})")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
