"""A command's start and end as RL2 runs them, with Python's cyclic garbage collector off while the command imports
and everything frozen out of its passes at its entry point and at its end (RL2/utils/startup_gc.py), against the same
module run from a program that imports RL2 (`runpy` from `python -c`: the collector on throughout, as before).
Rows: `python -m RL2.<command> --help` (every import a run makes, and its config's parsing) for each of
`--commands`, and a whole run: `python -m RL2.trainer.sft` of the bundled model for `--run-steps` steps on 8 short
chats, one rank, its final export included. The best of `--repeats` processes each, and their peak resident memory.

    python benchmarks/bench_startup.py [--commands trainer.sft,trainer.ppo,evaluate] [--run-steps 1] [--repeats 3]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO


def process(argv: list[str]) -> tuple[float, float]:
    """Seconds and peak resident GB of one process `python argv`, from its start to its exit."""
    began = time.perf_counter()
    child = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=os.environ | {"WANDB_MODE": "disabled"})
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"python {' '.join(argv)} failed: {child.stderr.read().decode()[-2000:]}")
    return seconds, usage.ru_maxrss * 1024 / 1e9


def both_ways(module: str, args: list[str], repeats: int) -> dict[str, tuple[float, float]]:
    """The best seconds and the peak GB of `module args` started as RL2's command and from a program."""
    as_command = ["-m", module, *args]
    from_a_program = ["-c", f"import runpy, sys; sys.argv = {[module, *args]!r}; "
                            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"]
    runs = {"command": [], "program": []}
    for _ in range(repeats):  # in turn, so that a busy moment slows both alike
        runs["command"].append(process(as_command))
        runs["program"].append(process(from_a_program))
    return {kind: (min(s for s, _ in found), max(gb for _, gb in found)) for kind, found in runs.items()}


def sft_run(folder: Path, steps: int) -> list[str]:
    """The arguments of a short SFT of the bundled model, its data written into `folder`."""
    chats = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                           {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]}
             for a in range(4) for b in (1, 2)]
    data = folder / "chats.jsonl"
    data.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    return [f"data.train.path={data}", "data.train.batch_size=8", "actor.model_name=smollm2-135m-instruct",
            f"trainer.total_steps={steps}", f"trainer.save_dir={folder / 'run'}", "trainer.keep_last_n=1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commands", default="trainer.sft,trainer.ppo,evaluate")
    parser.add_argument("--run-steps", type=int, default=1, help="steps of the whole SFT run; 0: no such row")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [(f"python -m RL2.{command} --help", f"RL2.{command}", ["--help"]) for command in args.commands.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        if args.run_steps:
            rows.append((f"python -m RL2.trainer.sft, {args.run_steps} step(s) of the bundled model, 1 rank",
                         "RL2.trainer.sft", sft_run(Path(folder), args.run_steps)))
        print("| process | as RL2's command s | peak RSS GB | from a program s | peak RSS GB | time saved |")
        print("|---|---|---|---|---|---|")
        for name, module, module_args in rows:
            timed = both_ways(module, module_args, args.repeats)
            (fast, fast_gb), (slow, slow_gb) = timed["command"], timed["program"]
            print(f"| {name} | {fast:.2f} | {fast_gb:.2f} | {slow:.2f} | {slow_gb:.2f} | {1 - fast / slow:.0%} |")


if __name__ == "__main__":
    main()
