"""A finished run frees its process groups before the interpreter's teardown: no gloo thread is left
when the last exit handler runs (see `RL2.parallel.close_process_groups`). Each run starts as users start it,
with `scripts/threads_at_exit/` on PYTHONPATH: its `sitecustomize` lists the process-group threads still alive
at that point in every process."""

import json
import os

import pytest

from tests.e2e.test_api import api_overrides
from tests.e2e.test_sft_trainer import sft_args, sft_data  # noqa: F401 (a fixture)
from tests.helpers import SCRIPTS
from tests.helpers.launch import run_ranks


def left_at_exit(nproc: int, target: list[str], folder, monkeypatch) -> list[list[dict]]:
    """What each rank's processes (the rank's own, and any it started) left at exit, one record a process."""
    monkeypatch.setenv("THREADS_AT_EXIT_DIR", str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SCRIPTS / "threads_at_exit"),
                                                                   os.environ.get("PYTHONPATH")])))
    run_ranks(nproc, target)
    ranks = [[json.loads(file.read_text()) for file in sorted(folder.glob(f"threads-rank{rank}-*.json"))]
             for rank in range(nproc)]
    assert all(ranks), f"a rank recorded nothing: {ranks}"
    return ranks


def threads_at_exit(nproc: int, target: list[str], folder, monkeypatch) -> list[list[str]]:
    """The group threads left at exit in each rank's processes, joined."""
    ranks = left_at_exit(nproc, target, folder, monkeypatch)
    return [sorted(name for record in records for name in record["threads"]) for records in ranks]


@pytest.mark.parametrize("nproc", [1, 2])
def test_trainer_leaves_no_group_threads(tiny_model_path, sft_data, tmp_path, monkeypatch, nproc):  # noqa: F811
    """... and leaves the interpreter's exit little to walk: a finished command freezes what is left
    (`RL2.utils.startup_gc.command_ends`), which would otherwise be hundreds of thousands of objects."""
    args = sft_args(tiny_model_path, sft_data, tmp_path / "run", "trainer.total_steps=2")
    ranks = left_at_exit(nproc, args, tmp_path, monkeypatch)
    assert [[record["threads"] for record in records] for records in ranks] == [[[]]] * nproc
    for (record,) in ranks:
        assert record["walked"] < record["frozen"] / 20, record


TRAIN_ONLY = """import json, sys
import RL2

def reward(response, extra_info):
    return 1.0

RL2.train("ppo", json.loads(sys.argv[1]), reward=reward)
"""


@pytest.mark.parametrize("nproc", [1, 2])
def test_api_leaves_no_group_threads(tiny_model_path, tmp_path, monkeypatch, nproc):
    """A script whose last call is `RL2.train`. In a plain process the call frees its one-rank group
    before it returns (nothing later collects what the trainer left); under torchrun the group stays for
    further calls and the exit handler RL2 registers frees it."""
    train, _ = api_overrides(tiny_model_path, tmp_path, prompts=4, steps=1)
    (tmp_path / "train_only.py").write_text(TRAIN_ONLY)
    script = [str(tmp_path / "train_only.py"), json.dumps(train)]
    assert threads_at_exit(nproc, script, tmp_path, monkeypatch) == [[]] * nproc


def test_api_after_an_uncaught_error_only_forgets_the_group(tiny_model_path, tmp_path, monkeypatch):
    """Under torchrun, a script that raises after `RL2.train` may have left collectives of its own queued,
    which freeing the group would wait for: the exit handler then only destroys it, and the error is
    what the run reports."""
    train, _ = api_overrides(tiny_model_path, tmp_path, prompts=4, steps=1)
    failing = TRAIN_ONLY + 'raise RuntimeError("the script failed after training")\n'
    (tmp_path / "train_then_fail.py").write_text(failing)
    script = [str(tmp_path / "train_then_fail.py"), json.dumps(train)]
    with pytest.raises(AssertionError, match="the script failed after training"):
        threads_at_exit(2, script, tmp_path, monkeypatch)
    for rank in range(2):
        files = tmp_path.glob(f"threads-rank{rank}-*.json")
        assert "pt_gloo_runloop" in [name for file in files for name in json.loads(file.read_text())["threads"]]
