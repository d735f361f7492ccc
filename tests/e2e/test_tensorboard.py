"""TensorBoard: every metric of metrics.jsonl as a scalar, for an SFT and a PPO run, across a resume.

TensorBoard keeps scalars as float32: each point must be exactly float32 of metrics.jsonl's value.
Event files are read two ways: by TensorBoard's own `EventAccumulator`, and by parsing the record
framing here (so that nothing relies on a reader hiding rolled-back steps).
"""

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from RL2.config import ConfigError
from RL2.utils.logging import MetricsSink
from tests.helpers import ENVS
from tests.helpers.launch import REPO, read_metrics, run_ranks
from tests.helpers.tiny import sharpened_copy

EMIT_ENV = ENVS / "emit_token.py"
needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="tensorboard is not installed (pip install 'RL2[tensorboard]')",
)


def raw_events(folder: Path) -> list:
    """Every event of every event file (oldest file first), parsed from the TFRecord framing:
    an 8-byte length, its 4-byte CRC, the Event proto, the proto's 4-byte CRC."""
    from tensorboard.compat.proto.event_pb2 import Event

    events = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            events.append(Event.FromString(data[offset + 12:offset + 12 + length]))
            offset += 12 + length + 4
        assert offset == len(data), f"{path} ends in a partial record"
    return events


def raw_points(folder: Path) -> dict[str, list[tuple[int, float]]]:
    points = {}
    for event in raw_events(folder):
        for value in event.summary.value:
            points.setdefault(value.tag, []).append((event.step, value.simple_value))
    return points


def accumulator_points(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows, with its purging of restarted runs off: the files alone must be right."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def jsonl_points(save_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's numbers, rounded to float32 as TensorBoard stores them."""
    points = {}
    for row in read_metrics(save_dir):
        for key, value in row.items():
            if key != "step":
                points.setdefault(key, []).append((row["step"], float(np.float32(value))))
    return points


def assert_tensorboard_equals_jsonl(save_dir: Path) -> None:
    expected = jsonl_points(save_dir)
    folder = save_dir / "tensorboard"
    for points in (raw_points(folder), accumulator_points(folder)):
        assert sorted(points) == sorted(expected)
        for tag, tag_points in points.items():
            assert tag_points == expected[tag], tag
            steps = [step for step, _ in tag_points]
            assert steps == sorted(set(steps)), f"{tag}: duplicate or out-of-order steps {steps}"


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


# --- whole runs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tb_sft") / "train.jsonl"
    rows = [{"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."}
            for a in range(6) for b in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@needs_tensorboard
def test_sft_run_and_its_resume_write_metrics_jsonl(tiny_model_path, sft_data, tmp_path):
    args = ["-m", "RL2.trainer.sft", f"data.train.path={sft_data}", "data.test_ratio=0.25",
            "data.train.batch_size=6", f"actor.model_name={tiny_model_path}", "actor.dtype=float32",
            "actor.optimizer.lr=1e-3", "actor.max_length_per_device=160", f"trainer.save_dir={tmp_path}",
            "trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=2", "trainer.use_tensorboard=true"]
    run_ranks(2, args)
    assert_tensorboard_equals_jsonl(tmp_path)
    # Resume from step 2 in the same folder: steps 3 and 4 are rolled back and written again.
    run_ranks(2, [*args, f"trainer.load_ckpt_from={tmp_path / 'step2'}"])
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]
    assert_tensorboard_equals_jsonl(tmp_path)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # rank 0 only, one per run


@needs_tensorboard
def test_ppo_run_writes_metrics_jsonl(tiny_model_path, tmp_path, tmp_path_factory):
    model = sharpened_copy(tiny_model_path, tmp_path_factory.mktemp("tb_repeat_model"))
    data = {}
    for split, n in (("train", 8), ("test", 4)):
        data[split] = tmp_path / f"{split}.jsonl"
        rows = [{"prompt": f"{split} question {k}", "extra_info": {"data_source": "emit"}} for k in range(n)]
        data[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_ranks(1, ["-m", "RL2.trainer.ppo", f"data.train.path={data['train']}", f"data.test.path={data['test']}",
                  "data.train.batch_size=4", f"rollout.env_path={EMIT_ENV}", "rollout.responses_per_prompt=4",
                  "rollout.train_sampling_params.max_new_tokens=4", "rollout.test_sampling_params.max_new_tokens=4",
                  f"actor.model_name={model}", "actor.dtype=float32", "actor.max_length_per_device=512",
                  f"trainer.save_dir={tmp_path / 'run'}", "trainer.total_steps=2", "trainer.test_freq=1",
                  "trainer.use_tensorboard=true"])
    tags = set(jsonl_points(tmp_path / "run"))
    assert {"rollout/reward", "actor/loss", "adv/mean", "perf/step_s", "test/emit/score"} <= tags
    assert_tensorboard_equals_jsonl(tmp_path / "run")
