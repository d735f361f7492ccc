"""Runs that record, in every process, the process-group threads still alive when the interpreter's last
exit handler runs (`tests/e2e/scripts/threads_at_exit/sitecustomize.py`): see
tests/e2e/test_process_group_teardown.py. Any run can record them, so checks share runs other tests make."""

import json
import os
from pathlib import Path

from tests.helpers import SCRIPTS


def record_threads_at_exit(folder: Path, monkeypatch) -> None:
    """Processes started after this (with `monkeypatch`'s environment) write their records to `folder`, made here."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("THREADS_AT_EXIT_DIR", str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SCRIPTS / "threads_at_exit"),
                                                                   os.environ.get("PYTHONPATH")])))


def left_at_exit(folder: Path, nproc: int) -> list[list[dict]]:
    """What each rank's processes (the rank's own, and any it started) left at exit, one record a process."""
    ranks = [[json.loads(file.read_text()) for file in sorted(Path(folder).glob(f"threads-rank{rank}-*.json"))]
             for rank in range(nproc)]
    assert all(ranks), f"a rank recorded nothing: {ranks}"
    return ranks


def group_threads_at_exit(folder: Path, nproc: int) -> list[list[str]]:
    """The group threads left at exit in each rank's processes, joined."""
    return [sorted(name for record in records for name in record["threads"]) for records in left_at_exit(folder, nproc)]


def assert_a_finished_command_left_nothing(folder: Path, nproc: int) -> None:
    """No group thread in any process, and little for the interpreter's exit to walk: a finished command
    freezes what is left (`RL2.utils.startup_gc.command_ends`), which would otherwise be hundreds of
    thousands of objects."""
    ranks = left_at_exit(folder, nproc)
    assert [[record["threads"] for record in records] for records in ranks] == [[[]]] * nproc
    for (record,) in ranks:
        assert record["walked"] < record["frozen"] / 20, record
