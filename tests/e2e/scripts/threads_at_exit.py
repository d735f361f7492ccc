"""Run a module or script (`-m NAME args...` or `PATH args...`) and, at the very end of the interpreter's
exit handlers, write the names of this process's threads that belong to a process group (gloo's run
loops and TCP event loops) to `$THREADS_AT_EXIT_DIR/threads-rank<R>.json`.

The handler is registered before the target runs, so it runs after every handler the target registers
(atexit runs them last-in, first-out): after RL2's own teardown of its process groups.
"""

import atexit
import json
import os
import runpy
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
    (folder / f"threads-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(group_threads()))


if __name__ == "__main__":
    atexit.register(record)
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
