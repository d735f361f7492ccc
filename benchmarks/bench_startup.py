"""A command's start: `python -m RL2.<command> --help` (every import a run makes, and its config's parsing) as RL2
starts it, with Python's cyclic garbage collector off while it imports (RL2/utils/startup_gc.py), against the same
module run from a program that imports RL2 (`runpy` from `python -c`: the collector on throughout). The best of
`--repeats` starts each, and each start's peak resident memory.

    python benchmarks/bench_startup.py [--commands trainer.sft,trainer.ppo,evaluate] [--repeats 3]
"""

import argparse
import os
import subprocess
import sys
import time

from common import REPO


def start(argv: list[str]) -> tuple[float, float]:
    """Seconds and peak resident GB of one start of `python argv`."""
    began = time.perf_counter()
    child = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"python {' '.join(argv)} failed: {child.stderr.read().decode()[-2000:]}")
    return seconds, usage.ru_maxrss * 1024 / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commands", default="trainer.sft,trainer.ppo,evaluate")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| command | RL2's start s | peak RSS GB | from a program s | peak RSS GB | time saved |")
    print("|---|---|---|---|---|---|")
    for command in args.commands.split(","):
        module = f"RL2.{command}"
        as_command = ["-m", module, "--help"]
        from_a_program = ["-c", f"import runpy, sys; sys.argv = [{module!r}, '--help']; "
                                f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"]
        runs = {"command": [], "program": []}
        for _ in range(args.repeats):  # in turn, so that a busy moment slows both alike
            runs["command"].append(start(as_command))
            runs["program"].append(start(from_a_program))
        (fast, fast_gb), (slow, slow_gb) = (min(runs[kind]) for kind in ("command", "program"))
        print(f"| python -m {module} --help | {fast:.2f} | {fast_gb:.2f} | {slow:.2f} | {slow_gb:.2f} | "
              f"{1 - fast / slow:.0%} |")


if __name__ == "__main__":
    main()
