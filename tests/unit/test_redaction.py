"""Keys stay out of what a run writes down (`RL2.utils.redaction`): the SGLang servers' rollout.api_key in
the config wandb records and in the command line the save_dir's lock records."""

import json
import sys
import time

from omegaconf import OmegaConf

from RL2.utils.logging import MetricsSink
from RL2.utils.redaction import REDACTED, redact_command, redact_config
from RL2.utils.save_dir_lock import claim_save_dir

SECRET = "s3cret-key-4711"


def test_secret_keys_are_redacted_wherever_they_sit():
    config = {"rollout": {"api_key": SECRET, "server_args": {"admin_api_key": SECRET, "tp_size": 2},
                          "server_url": None}, "actor": {"lr": 1e-6}, "list": [{"api_key": SECRET}],
              "unset": {"api_key": None}}
    assert redact_config(config) == {
        "rollout": {"api_key": REDACTED, "server_args": {"admin_api_key": REDACTED, "tp_size": 2}, "server_url": None},
        "actor": {"lr": 1e-6}, "list": [{"api_key": REDACTED}], "unset": {"api_key": None}}
    assert redact_command(["-m", "RL2.trainer.ppo", f"rollout.api_key={SECRET}",
                           f"++rollout.server_args.admin_api_key={SECRET}", "--api-key", SECRET, "actor.lr=1e-6"]) == [
        "-m", "RL2.trainer.ppo", f"rollout.api_key={REDACTED}", f"++rollout.server_args.admin_api_key={REDACTED}",
        "--api-key", REDACTED, "actor.lr=1e-6"]


def test_the_save_dir_lock_records_the_command_without_the_key(tmp_path, one_rank, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["RL2/trainer/ppo.py", f"rollout.api_key={SECRET}", "trainer.n_epochs=1"])
    release = claim_save_dir(str(tmp_path))
    try:
        lock = (tmp_path / "run.lock").read_text()
    finally:
        release()
    assert SECRET not in lock
    assert json.loads(lock)["command"] == f"RL2/trainer/ppo.py rollout.api_key={REDACTED} trainer.n_epochs=1"


def test_wandb_records_the_config_without_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = OmegaConf.create({"rollout": {"api_key": SECRET, "server_args": {"admin_api_key": SECRET}}})
    sink = MetricsSink(str(tmp_path), use_wandb=True, project="p", name="n", config=config)
    sink.log({"train/loss": 1.5}, 1)
    sink.close()
    # wandb's service process writes the run's record file; a second run in one process can see `finish()`
    # return before that file is whole, so wait for the record (up to a minute) before reading every file.
    deadline = time.monotonic() + 60
    while not any(REDACTED.encode() in path.read_bytes() for path in (tmp_path / "wandb").rglob("*.wandb")):
        assert time.monotonic() < deadline, "no .wandb record with the redacted config"
        time.sleep(0.2)
    written = [path for path in (tmp_path / "wandb").rglob("*") if path.is_file()]
    assert not [path for path in written if SECRET.encode() in path.read_bytes()]
