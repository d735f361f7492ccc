"""A finished run frees its process groups before the interpreter's teardown: no gloo thread is left
when the last exit handler runs (see `RL2.parallel.close_process_groups`). Each run goes through
`scripts/threads_at_exit.py`, which lists the process-group threads still alive at that point."""

import json

import pytest

from tests.e2e.test_api import train_api_script
from tests.e2e.test_sft_trainer import sft_args, sft_data  # noqa: F401 (a fixture)
from tests.helpers import SCRIPTS
from tests.helpers.launch import run_ranks


def threads_at_exit(nproc: int, target: list[str], folder, monkeypatch) -> list[list[str]]:
    monkeypatch.setenv("THREADS_AT_EXIT_DIR", str(folder))
    run_ranks(nproc, [str(SCRIPTS / "threads_at_exit.py"), *target])
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.parametrize("nproc", [1, 2])
def test_trainer_leaves_no_group_threads(tiny_model_path, sft_data, tmp_path, monkeypatch, nproc):  # noqa: F811
    args = sft_args(tiny_model_path, sft_data, tmp_path / "run", "trainer.total_steps=2")
    assert threads_at_exit(nproc, args, tmp_path, monkeypatch) == [[]] * nproc


def test_api_under_torchrun_leaves_no_group_threads(tiny_model_path, tmp_path, monkeypatch):
    """`RL2.train` then `RL2.evaluate` in one script: the group stays between the calls and is freed by
    the exit handler RL2 registers."""
    script = train_api_script(tiny_model_path, tmp_path, prompts=4, steps=1)
    assert threads_at_exit(2, script, tmp_path, monkeypatch) == [[], []]
