"""What a checkpoint save and resume may and may not do: RNG files that load without running code,
failed saves that leave nothing behind, fsynced small files, and one run per save_dir."""

import builtins
import errno
import json
import os
import random
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException

from RL2.config import ConfigError
from RL2.config.schema import SFTConfig
from RL2.trainer.base import Trainer
from RL2.utils import checkpoint, save_dir_lock
from RL2.utils.checkpoint import load_checkpoint, save_checkpoint
from RL2.utils.save_dir_lock import claim_save_dir
from tests.helpers import REPO


def draws() -> tuple:
    return random.random(), float(np.random.rand()), np.random.randn(3).tolist(), torch.rand(3).tolist()


# ---- RNG files ----


def test_a_resume_restores_every_random_stream(tmp_path, one_rank):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # NumPy holds a cached Gaussian: restored too
    path = save_checkpoint(str(tmp_path), 1, {}, {})
    expected = draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_checkpoint(path, {})
    assert draws() == expected
    # Tensors and plain numbers only: readable without unpickling any object.
    torch.load(path / "rng_rank0.pt", weights_only=True)


class Payload:
    """Unpickling this creates the file `marker`: what a planted RNG file could run instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def test_a_planted_rng_file_does_not_run_on_resume(tmp_path, one_rank):
    path = save_checkpoint(str(tmp_path / "run"), 1, {}, {})
    marker = tmp_path / "ran"
    torch.save({"python": Payload(marker), "numpy": None, "torch": torch.get_rng_state()}, path / "rng_rank0.pt")
    with pytest.raises(ConfigError, match=r"rng_rank0\.pt holds more than random-number state .* delete it to resume"):
        load_checkpoint(path, {})
    assert not marker.exists()


# ---- failed saves ----


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def dcp_fails(*args, **kwargs):
    # What torch.distributed.checkpoint raises when a rank's write fails: a BaseException, not an Exception.
    raise CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), [])})


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("target,failure,raised", [
    ("dcp.save", dcp_fails, CheckpointException),
    ("dcp.save", interrupted, KeyboardInterrupt),
    ("rng_state", no_space, OSError),  # the RNG file
    ("write_synced", no_space, OSError),  # trainer_state.json
])
def test_a_failed_save_leaves_nothing_behind(tmp_path, one_rank, monkeypatch, target, failure, raised):
    save_checkpoint(str(tmp_path), 1, {}, {})
    owner, name = (checkpoint.dcp, "save") if target == "dcp.save" else (checkpoint, target)
    monkeypatch.setattr(owner, name, failure)
    with pytest.raises(raised):
        save_checkpoint(str(tmp_path), 2, {}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.txt", "step1"]
    assert (tmp_path / "latest.txt").read_text() == "step1"


def test_a_failed_export_removes_its_temporary_folder(tmp_path):
    with pytest.raises(CheckpointException):
        with checkpoint.atomic_dir(tmp_path / "final"):
            dcp_fails()
    assert list(tmp_path.iterdir()) == []


def test_the_small_files_and_their_folders_are_fsynced(tmp_path, one_rank, monkeypatch):
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_checkpoint(str(tmp_path), 1, {}, {})
    tmp = tmp_path / ".step1.tmp"  # the names at the time: everything is renamed into place after
    for path in (tmp / "rng_rank0.pt", tmp / "trainer_state.json", tmp, tmp_path, tmp_path / ".latest.txt.tmp"):
        assert str(path) in synced, path
    # latest.txt is renamed into place after its content is on disk, and the folder after the rename.
    assert synced.index(str(tmp_path / ".latest.txt.tmp")) < len(synced) - 1 and synced[-1] == str(tmp_path)


# ---- one run per save_dir ----


@pytest.fixture
def other_process():
    """A live process of this host other than this one, as the first run would be."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def plant_lock(save_dir, pid: int, host: str | None = None, process_start: str | None = None):
    save_dir.mkdir(parents=True, exist_ok=True)
    holder = {"pid": pid, "host": host or socket.gethostname(), "started": "2025-01-01 00:00:00",
              "command": "-m RL2.trainer.sft", "process_start": process_start or save_dir_lock._process_start(pid)}
    (save_dir / "run.lock").write_text(json.dumps(holder))


def test_the_run_holds_save_dir_until_it_releases_it(tmp_path, one_rank):
    release = claim_save_dir(str(tmp_path / "run"))
    holder = json.loads((tmp_path / "run" / "run.lock").read_text())
    assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
    release()
    assert not (tmp_path / "run" / "run.lock").exists()


def test_a_second_run_refuses_naming_the_first(tmp_path, one_rank, other_process):
    plant_lock(tmp_path, other_process.pid)
    message = (rf"trainer\.save_dir={tmp_path} is in use by process {other_process.pid} on host "
               rf"{socket.gethostname()}, started .*Give this run another trainer\.save_dir .*or wait for that run")
    with pytest.raises(ConfigError, match=message):
        claim_save_dir(str(tmp_path))
    # The first run is gone (killed: no chance to remove its lock): its lock blocks no one.
    other_process.kill()
    other_process.wait()
    claim_save_dir(str(tmp_path))()


def test_a_lock_whose_pid_now_names_another_process_is_stale(tmp_path, one_rank, other_process):
    plant_lock(tmp_path, other_process.pid, process_start="1")  # the pid came back for a later process
    claim_save_dir(str(tmp_path))()


def test_a_lock_from_another_host_says_how_to_clear_it(tmp_path, one_rank):
    plant_lock(tmp_path, 12345, host="node-7")
    with pytest.raises(ConfigError, match=rf"process 12345 on host node-7, .* remove {tmp_path}/run\.lock"):
        claim_save_dir(str(tmp_path))


# Another run claiming a save_dir in a process of its own: it says whether it got the lock, then holds it
# until its standard input closes.
CLAIM = """
import sys
from pathlib import Path
from RL2.config import ConfigError
from RL2.utils.save_dir_lock import _take_lock
try:
    _take_lock(Path(sys.argv[1]))
    print("held", flush=True)
except ConfigError:
    print("refused", flush=True)
sys.stdin.read()
"""


def start_claim(save_dir) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-c", CLAIM, str(save_dir)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)})
    answer = ""
    while answer not in ("held", "refused") and process.poll() is None:  # after what it logs, if anything
        answer = process.stdout.readline().strip()
    return process, answer


def test_two_runs_taking_over_a_stale_lock_at_once_cannot_both_win(tmp_path, one_rank, monkeypatch):
    """A stale lock (its process gone) taken over by two runs at once: another run claims the save_dir
    between this run's look at the lock and its move. One of them holds it, the other is refused (before the
    lock was an flock, each removed the file the other had made and both went on)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    plant_lock(tmp_path, gone.pid, process_start="1")
    other = {}
    read_lock = save_dir_lock._read_lock

    def read_while_another_run_claims(path):
        holder = read_lock(path)
        if not other:
            other["process"], other["answer"] = start_claim(tmp_path)
        return holder

    monkeypatch.setattr(save_dir_lock, "_read_lock", read_while_another_run_claims)
    try:
        release, won = claim_save_dir(str(tmp_path)), True
    except ConfigError:
        release, won = (lambda: None), False
    try:
        assert other["answer"] in ("held", "refused")
        assert won + (other["answer"] == "held") == 1, f"this run won: {won}; the other: {other['answer']}"
    finally:
        other["process"].communicate("")
        release()


def test_a_killed_run_leaves_the_save_dir_free_and_a_live_one_holds_it(tmp_path, one_rank):
    """The lock is held by the process itself: refused while it lives, free once it is killed (its file
    still naming it), with no stale-lock check involved."""
    holder, answer = start_claim(tmp_path)
    assert answer == "held"
    try:
        with pytest.raises(ConfigError, match=f"in use by process {holder.pid}"):
            claim_save_dir(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == holder.pid
    claim_save_dir(str(tmp_path))()


def test_a_trainer_refuses_a_save_dir_in_use_before_writing_to_it(tmp_path, one_rank, other_process):
    plant_lock(tmp_path, other_process.pid)
    cfg = OmegaConf.merge(OmegaConf.structured(SFTConfig), {"trainer": {"save_dir": str(tmp_path), "device": "cpu"}})
    with pytest.raises(ConfigError, match=f"in use by process {other_process.pid}"):
        Trainer(cfg, cfg.actor)
    assert [p.name for p in tmp_path.iterdir()] == ["run.lock"]  # no metrics.jsonl of the second run
    other_process.kill()
    other_process.wait()
    Trainer(cfg, cfg.actor).release_save_dir()


class Counting(Trainer):
    """A trainer with no model: the run loop, its checkpoints and its save_dir alone."""

    def workers(self) -> dict:
        return {}

    def train_step(self, step: int) -> dict[str, float]:
        return {"train/loss": 1.0 / step}


def test_the_run_loop_keeps_the_last_n_checkpoints_and_releases_save_dir(tmp_path, one_rank):
    cfg = OmegaConf.merge(OmegaConf.structured(SFTConfig),
                          {"trainer": {"save_dir": str(tmp_path), "device": "cpu", "save_freq": 1, "keep_last_n": 2}})
    run = Counting(cfg, cfg.actor)
    assert (tmp_path / "run.lock").exists()
    run.run(4)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step")) == ["step3", "step4"]
    assert not (tmp_path / "run.lock").exists()


def test_a_fresh_run_in_a_finished_runs_save_dir_is_warned(tmp_path, one_rank, capsys):
    """A second run without trainer.load_ckpt_from in a save_dir with checkpoints would mix its steps into the
    earlier run's: it says so, naming the earlier run's latest step and both ways out; a resume does not."""
    settings = {"trainer": {"save_dir": str(tmp_path), "device": "cpu", "save_freq": 1}}
    cfg = OmegaConf.merge(OmegaConf.structured(SFTConfig), settings)
    first = Counting(cfg, cfg.actor)
    first.run(2)
    assert "holds the checkpoints of an earlier run" not in capsys.readouterr().out
    fresh = Counting(cfg, cfg.actor)
    fresh.release_save_dir()
    assert re.search(rf"warning: trainer\.save_dir={tmp_path} holds the checkpoints of an earlier run \(the latest is "
                     rf"step2\) and this run starts afresh.*trainer\.load_ckpt_from=latest.*another trainer\.save_dir",
                     capsys.readouterr().out)
    resumed = OmegaConf.merge(cfg, {"trainer": {"load_ckpt_from": "latest"}})
    Counting(resumed, resumed.actor).release_save_dir()
    assert "holds the checkpoints of an earlier run" not in capsys.readouterr().out
