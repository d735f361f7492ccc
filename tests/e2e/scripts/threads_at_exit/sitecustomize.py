"""Loaded by every Python process started with this folder on PYTHONPATH (Python imports `sitecustomize` at
start): at the very end of the interpreter's exit handlers, write the names of this process's threads that
belong to a process group (gloo's run loops and TCP event loops), and how many objects the garbage collector's exit
passes will walk and how many are frozen out of them, to `$THREADS_AT_EXIT_DIR/threads-rank<R>-<pid>.json` (a rank's
child processes, which inherit its environment, write files of their own).

The handler is registered before the command or script runs, started as users start it (`python -m
RL2.trainer.sft`, a script), so it runs after every handler they register (atexit runs them last-in,
first-out): after RL2's own teardown of its process groups. torchrun's own process records nothing.
"""

import atexit
import gc
import json
import os
import sys
from pathlib import Path


def group_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path("/proc/self/task", task, "comm").read_text().strip())
        except OSError:  # the thread ended since the listing
            pass
    return sorted(name for name in names if "gloo" in name)


def record() -> None:
    folder = Path(os.environ["THREADS_AT_EXIT_DIR"])
    name = f"threads-rank{os.environ.get('RANK', '0')}-{os.getpid()}.json"
    left = {"threads": group_threads(), "walked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}
    (folder / name).write_text(json.dumps(left))


if os.environ.get("THREADS_AT_EXIT_DIR") and "torch.distributed.run" not in sys.orig_argv:
    atexit.register(record)
