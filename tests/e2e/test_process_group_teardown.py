"""A finished run frees its process groups before the interpreter's teardown: no gloo thread is left
when the last exit handler runs (see `RL2.parallel.close_process_groups`). Each run starts as users start it,
with `scripts/threads_at_exit/` on PYTHONPATH: its `sitecustomize` lists the process-group threads still alive
at that point in every process."""

import json

import pytest

from tests.e2e.test_api import api_overrides
from tests.e2e.test_sft_trainer import sft_args, sft_data  # noqa: F401 (a fixture)
from tests.helpers.launch import run_ranks
from tests.helpers.threads_at_exit import (
    assert_a_finished_command_left_nothing,
    group_threads_at_exit,
    record_threads_at_exit,
)


def test_trainer_leaves_no_group_threads(tiny_model_path, sft_data, tmp_path, monkeypatch):  # noqa: F811
    """One process (2 ranks: test_sft_trainer.py's 2-rank run records the same)."""
    record_threads_at_exit(tmp_path, monkeypatch)
    run_ranks(1, sft_args(tiny_model_path, sft_data, tmp_path / "run", "trainer.total_steps=2"))
    assert_a_finished_command_left_nothing(tmp_path, 1)


TRAIN_ONLY = """import json, sys
import RL2

def reward(response, extra_info):
    return 1.0

RL2.train("ppo", json.loads(sys.argv[1]), reward=reward)
"""


def test_api_leaves_no_group_threads(tiny_model_path, tmp_path, monkeypatch):
    """A script whose last call is `RL2.train`, in a plain process: the call frees its one-rank group
    before it returns (nothing later collects what the trainer left). Under torchrun the group stays for
    further calls and the exit handler RL2 registers frees it: test_api.py's 2-rank run records that."""
    train, _ = api_overrides(tiny_model_path, tmp_path, prompts=4, steps=1)
    (tmp_path / "train_only.py").write_text(TRAIN_ONLY)
    record_threads_at_exit(tmp_path, monkeypatch)
    run_ranks(1, [str(tmp_path / "train_only.py"), json.dumps(train)])
    assert group_threads_at_exit(tmp_path, 1) == [[]]


def test_api_after_an_uncaught_error_only_forgets_the_group(tiny_model_path, tmp_path, monkeypatch):
    """Under torchrun, a script that raises after `RL2.train` may have left collectives of its own queued,
    which freeing the group would wait for: the exit handler then only destroys it, and the error is
    what the run reports."""
    train, _ = api_overrides(tiny_model_path, tmp_path, prompts=4, steps=1)
    failing = TRAIN_ONLY + 'raise RuntimeError("the script failed after training")\n'
    (tmp_path / "train_then_fail.py").write_text(failing)
    script = [str(tmp_path / "train_then_fail.py"), json.dumps(train)]
    record_threads_at_exit(tmp_path, monkeypatch)
    with pytest.raises(AssertionError, match="the script failed after training"):
        run_ranks(2, script)
    for rank in range(2):
        files = tmp_path.glob(f"threads-rank{rank}-*.json")
        assert "pt_gloo_runloop" in [name for file in files for name in json.loads(file.read_text())["threads"]]
