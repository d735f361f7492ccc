"""TensorBoard's event files as a run leaves them, read two ways: by TensorBoard's own `EventAccumulator`,
and by parsing the record framing here (so that nothing relies on a reader hiding rolled-back steps).
TensorBoard keeps scalars as float32: each point must be exactly float32 of metrics.jsonl's value."""

import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.launch import read_metrics

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
needs_tensorboard = pytest.mark.skipif(not HAVE_TENSORBOARD,
                                       reason="tensorboard is not installed (pip install 'RL2[tensorboard]')")
# For runs that other checks share: TensorBoard's events where the package is there, so that without it only
# the TensorBoard checks skip.
TENSORBOARD_IF_INSTALLED = ["trainer.use_tensorboard=true"] if HAVE_TENSORBOARD else []


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
