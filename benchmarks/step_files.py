"""What a reader follows through one default GRPO step: the RL2 files and functions it enters.

Runs two steps of `examples/grpo_smollm2.sh`'s job at a small size in this process (world size 1, the
embedded engine) and traces the second one, after the first has built and warmed everything up. Prints
the files entered, split into the RL path and the parts a reader of the RL code can skip (the embedded
engine, `RL2/native/` and the wings: the code sandbox and the original RL2's translation), with the number of
distinct functions called in each.

    python examples/data/make_arithmetic.py --out data/arith
    python benchmarks/step_files.py --train data/arith/rl_train.jsonl
"""

import argparse
import os
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import RL2
from RL2.trainer.ppo import PPOTrainer

PACKAGE = Path(RL2.__file__).parent
# What a reader of the RL code need not open.
SKIPPABLE = ("RL2/engine/embedded/", "RL2/native/", "RL2/sandbox/", "RL2/compat/")


def trace_step(train_path: str, traced_step: int = 2) -> Counter:
    """(file, function) -> calls, for RL2's own code during step `traced_step`, on every thread."""
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            file = os.path.relpath(frame.f_code.co_filename, PACKAGE.parent)
            calls[file, frame.f_code.co_name] += 1

    untraced = PPOTrainer.train_step

    def train_step(self, step):
        if step != traced_step:
            return untraced(self, step)
        sys.setprofile(profile)
        threading.setprofile(profile)
        try:
            return untraced(self, step)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    PPOTrainer.train_step = train_step
    with tempfile.TemporaryDirectory() as save_dir:
        RL2.train("ppo", {
            "data.train.path": train_path, "data.train.batch_size": 4, "rollout.env_path": "envs/arithmetic.py",
            "rollout.responses_per_prompt": 4, "rollout.train_sampling_params.max_new_tokens": 16,
            "actor.model_name": "smollm2-135m-instruct", "adv.estimator": "grpo",
            "trainer.total_steps": traced_step, "trainer.save_dir": save_dir,
        })
    PPOTrainer.train_step = untraced
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", required=True, help="RL prompts (examples/data/make_arithmetic.py's rl_train.jsonl)")
    calls = trace_step(parser.parse_args().train)
    functions = Counter(file for file, _ in calls)
    rl_path = sorted(file for file in functions if not file.startswith(SKIPPABLE))
    skippable = sorted(file for file in functions if file.startswith(SKIPPABLE))
    for title, files in (("RL path", rl_path), ("engine, native code and wings", skippable)):
        print(f"\n{title}: {len(files)} files, {sum(functions[f] for f in files)} functions")
        for file in files:
            print(f"  {functions[file]:4d}  {file}")


if __name__ == "__main__":
    main()
