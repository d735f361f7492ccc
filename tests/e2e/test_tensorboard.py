"""TensorBoard: the metrics sink writes every metric of metrics.jsonl as a scalar, flushed at each step,
and replaces rolled-back steps on a resume; a missing tensorboard package is named at start. Whole runs
are checked where they already run: every trainer's in test_learning_curves.py, a 2-rank SFT run and its
resume in test_sft_trainer.py."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from RL2.config import ConfigError
from RL2.utils.logging import MetricsSink
from tests.helpers.launch import REPO
from tests.helpers.tensorboard import accumulator_points, assert_tensorboard_equals_jsonl, needs_tensorboard, raw_points

# --- the sink ---------------------------------------------------------------------------------------


@needs_tensorboard
def test_sink_writes_every_metric_flushed_at_each_step(tmp_path):
    sink = MetricsSink(str(tmp_path), use_tensorboard=True)
    logged = [
        (0, {"test/loss": 2.5}),
        (1, {"train/loss": 1.0 / 3.0, "train/tokens": 123457, "train/lr": torch.tensor(3e-5, dtype=torch.float64)}),
        (2, {"train/loss": 0.1234567891, "train/tokens": 17, "train/lr": 2.5e-5, "test/loss": -7.25}),
    ]
    for step, metrics in logged:
        sink.log(metrics, step)
    # Before close: every step is already on disk (a crash loses nothing metrics.jsonl has).
    assert raw_points(tmp_path / "tensorboard")["test/loss"] == [(0, 2.5), (2, -7.25)]
    sink.close()
    assert raw_points(tmp_path / "tensorboard")["train/loss"] == [
        (1, float(np.float32(1.0 / 3.0))), (2, float(np.float32(0.1234567891)))]
    assert_tensorboard_equals_jsonl(tmp_path)


@needs_tensorboard
def test_resume_replaces_the_rolled_back_steps(tmp_path):
    crashed = MetricsSink(str(tmp_path), use_tensorboard=True)
    for step in range(6):
        crashed.log({"train/loss": 10.0 + step, "train/lr": 0.5}, step)
    # Killed after step 5 without close; the checkpoint it resumes from is step 3.
    resumed = MetricsSink(str(tmp_path), use_tensorboard=True)
    resumed.truncate_after(3)
    for step in range(4, 8):
        resumed.log({"train/loss": 20.0 + step, "train/lr": 0.25}, step)
    resumed.close()
    crashed.close()  # only to end its writer thread; it has nothing left to write
    expected_loss = [(0, 10.0), (1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0), (7, 27.0)]
    assert raw_points(tmp_path / "tensorboard")["train/loss"] == expected_loss
    assert accumulator_points(tmp_path / "tensorboard")["train/loss"] == expected_loss
    assert [step for step, _ in raw_points(tmp_path / "tensorboard")["train/lr"]] == list(range(8))
    assert_tensorboard_equals_jsonl(tmp_path)
    assert not list((tmp_path / "tensorboard").glob("*.tmp"))


def test_missing_tensorboard_fails_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"trainer.use_tensorboard=true .*pip install tensorboard"):
        MetricsSink(str(tmp_path), use_tensorboard=True)
    MetricsSink(str(tmp_path)).log({"train/loss": 1.0}, 1)  # without the switch nothing needs it


def test_missing_tensorboard_stops_the_trainer_at_start(tmp_path):
    code = ("import sys; sys.modules['tensorboard'] = None; from RL2.trainer.sft import main; "
            f"main(['data.train.path=unused.jsonl', 'trainer.save_dir={tmp_path}', 'trainer.use_tensorboard=true'])")
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "RL2 sft: trainer.use_tensorboard=true needs the tensorboard package" in result.stderr
    assert "pip install tensorboard" in result.stderr and "Traceback" not in result.stderr
