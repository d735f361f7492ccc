"""Bounded asynchronous RL against synchronous RL, on a workload with a long tail of response lengths, in the
same run.

    python benchmarks/bench_async.py [--steps 6] [--etas 1,2] [--over-sampling 4] [--nproc 2]
                                     [--model smollm2-135m-instruct] [--correction icepop]

Workload (benchmarks/envs/long_tail.py): GRPO on small sums and differences, `--prompts` prompts a step x
`--responses` responses; one prompt in `--long-every` asks `--long-questions` questions one after another in
one conversation, the others one, each answer at most `--new-tokens` tokens: a few trajectories are many times
longer than the rest. A synchronous step waits for the longest. The asynchronous runs are RL2's partial
rollout with `rollout.over_sampling` groups kept in flight beyond the batch (a step trains on the first
groups to finish, the slowest are cut and carried on under the next weights), `rollout.max_staleness` at
each eta of `--etas` (a carried group more than eta updates behind is dropped) and `actor.correction`.

Prints, per run, from the steps after the first (which also starts up): the median seconds of a step and of
its rollout and update, the speed-up over the synchronous run, the tokens a step trained on (prompts,
answers and observations of its batch: a step that cut its slowest groups trains on shorter ones) and
those tokens per second of steps, the mean response length of the trajectories finished in a step, the
share of trained tokens sampled by older weights and the groups dropped for staleness, the held-out score
(greedy, the test split's mean) before training and after the last step, and the most memory all
processes held at once (see `common.tree_memory`). `--rounds N` runs every arm N times, alternating, for a
machine whose speed moves between minutes.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "examples" / "data")]
from common import cpu_kind, run_measured  # noqa: E402
from make_arithmetic import EXAMPLE, INSTRUCTION  # noqa: E402  (the answer format, shown once)

ENV = REPO / "benchmarks" / "envs" / "long_tail.py"


def question(rng: random.Random) -> tuple[str, int]:
    """A sum or difference of a number in 2..19 and a digit (non-negative), and its answer."""
    a, b = rng.randint(2, 19), rng.randint(1, 9)
    if rng.random() < 0.5:
        return f"What is {a} + {b}? {INSTRUCTION}", a + b
    return f"What is {max(a, b)} - {min(a, b)}? {INSTRUCTION}", max(a, b) - min(a, b)


def rows(n: int, long_every: int, long_questions: int, seed: int) -> list[dict]:
    """`n` prompts; every `long_every`-th asks `long_questions` questions, the others one."""
    rng, result = random.Random(seed), []
    for i in range(n):
        asked = [question(rng) for _ in range(long_questions if i % long_every == long_every - 1 else 1)]
        messages = [*EXAMPLE, {"role": "user", "content": asked[0][0]}]
        result.append({"prompt": messages, "extra_info": {
            "questions": [q for q, _ in asked], "answers": [str(a) for _, a in asked], "messages": messages,
            "data_source": "long_tail"}})
    return result


def arms(etas: list[int]) -> dict[str, list[str]]:
    """Run name -> its overrides of the shared command line."""
    result = {"synchronous": []}
    for eta in etas:
        result[f"async eta={eta}"] = ["rollout.partial_rollout=true", f"rollout.max_staleness={eta}"]
    return result


def run_arm(args, data_dir: Path, name: str, overrides: list[str]) -> dict:
    save_dir = data_dir / name.replace(" ", "_").replace("=", "")
    asynchronous = any(o.startswith("rollout.partial_rollout") for o in overrides)
    extra = [f"rollout.over_sampling={args.over_sampling}", f"actor.correction.type={args.correction}"] if (
        asynchronous) else []
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        "-m", "RL2.trainer.ppo", f"data.train.path={data_dir / 'train.jsonl'}",
        f"data.test.path={data_dir / 'test.jsonl'}", f"data.train.batch_size={args.prompts}",
        f"rollout.env_path={ENV}", f"rollout.responses_per_prompt={args.responses}",
        f"rollout.max_turns={args.long_questions}", f"rollout.train_sampling_params.max_new_tokens={args.new_tokens}",
        f"rollout.test_sampling_params.max_new_tokens={args.new_tokens}", f"actor.model_name={args.model}",
        f"actor.dtype={args.dtype}", f"actor.optimizer.lr={args.lr}", "actor.max_grad_norm=1.0",
        "adv.estimator=grpo", "adv.norm_var=true", f"trainer.total_steps={args.steps}",
        f"trainer.test_freq={args.steps}", f"trainer.save_dir={save_dir}", "trainer.save_freq=0",
        *overrides, *extra,
    ]
    log = (data_dir / f"{save_dir.name}.log").open("w")
    try:
        peak_gb = run_measured(command, {"WANDB_MODE": "disabled"}, stdout=log)
    except subprocess.CalledProcessError:
        sys.exit(f"the {name} run failed; its output is in {log.name}")
    metrics = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "perf/step_s" in m][1:]
    tests = [m for m in metrics if "test/score" in m]
    return {
        "step_s": statistics.median(m["perf/step_s"] for m in steps),
        "rollout_s": statistics.median(m["perf/rollout_s"] for m in steps),
        "update_s": statistics.median(m.get("perf/actor_update_s", 0.0) for m in steps),
        # Tokens of the update (prompts, actions and observations): the work a step trained on.
        "trained_tokens": statistics.mean(trained_tokens(m) for m in steps),
        "trained_per_s": sum(trained_tokens(m) for m in steps) / sum(m["perf/step_s"] for m in steps),
        "response_length": statistics.mean(m["rollout/response_length"] for m in steps),
        "lagged_share": statistics.mean(1.0 - m["staleness/lag_0"] for m in steps),
        "dropped": sum(m.get("staleness/dropped_groups", 0) for m in metrics),
        "score_before": tests[0]["test/score"], "score_after": tests[-1]["test/score"],
        "peak_gb": peak_gb,
    }


def trained_tokens(step: dict) -> float:
    """The tokens one step's update went over (its tokens per second times its seconds)."""
    return step.get("perf/actor_update_tokens_per_s", 0.0) * step.get("perf/actor_update_s", 0.0)


def report(runs: dict[str, dict], args) -> None:
    base = runs["synchronous"]["step_s"]
    print(f"\n{args.prompts} prompts x {args.responses} responses a step, one prompt in {args.long_every} asking "
          f"{args.long_questions} questions, <= {args.new_tokens} tokens an answer; {args.model}, {args.nproc} ranks; "
          f"async: over_sampling={args.over_sampling}, correction={args.correction}; medians of steps 2..{args.steps}; "
          f"{cpu_kind()}")
    print("| run | step s | rollout s | update s | speed-up | trained tokens a step | trained tokens/s | response "
          "tokens | lagged tokens | dropped groups | held-out score (before -> after) | all processes GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['step_s']:.1f} | {r['rollout_s']:.1f} | {r['update_s']:.1f} | {base / r['step_s']:.2f}x "
              f"| {r['trained_tokens']:.0f} | {r['trained_per_s']:.0f} | {r['response_length']:.0f} "
              f"| {r['lagged_share']:.0%} | {r['dropped']} | {r['score_before']:.3f} -> {r['score_after']:.3f} "
              f"| {r['peak_gb']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--etas", default="1,2", help="rollout.max_staleness of each asynchronous run")
    parser.add_argument("--over-sampling", type=int, default=4, help="rollout.over_sampling of the asynchronous runs")
    parser.add_argument("--correction", default="icepop", choices=["tis", "icepop", "seq_mask", "geo_mask"],
                        help="actor.correction.type of the asynchronous runs")
    parser.add_argument("--prompts", type=int, default=8, help="data.train.batch_size")
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--long-every", type=int, default=4, help="one prompt in this many asks several questions")
    parser.add_argument("--long-questions", type=int, default=6, help="questions of a long prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="the most tokens of one answer")
    parser.add_argument("--test-prompts", type=int, default=16)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="run every arm this many times, alternating")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: give at least 2; the table is of the steps after the first, which "
                     "also starts up")
    try:
        etas = [int(e) for e in args.etas.split(",") if e]
    except ValueError:
        parser.error(f"--etas {args.etas}: give comma-separated whole numbers of updates")
    if any(e < 0 for e in etas):
        parser.error(f"--etas {args.etas}: a staleness bound is at least 0")
    if args.long_every < 1 or args.long_questions < 1 or args.over_sampling < 1:
        parser.error("--long-every, --long-questions and --over-sampling must be at least 1")
    for round_index in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            data_dir = Path(tmp)
            n_train = args.prompts * (args.steps + 2) + args.over_sampling * args.steps
            for split, n, seed in (("train", n_train, 0), ("test", args.test_prompts, 1)):
                (data_dir / f"{split}.jsonl").write_text(
                    "".join(json.dumps(r) + "\n" for r in rows(n, args.long_every, args.long_questions, seed)))
            runs = {name: run_arm(args, data_dir, name, overrides) for name, overrides in arms(etas).items()}
        if args.rounds > 1:
            print(f"\nround {round_index + 1} of {args.rounds}")
        report(runs, args)


if __name__ == "__main__":
    main()
