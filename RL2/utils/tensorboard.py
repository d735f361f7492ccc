"""TensorBoard event files for the metrics sink: every numeric metric of a step as a scalar. TensorBoard stores
scalars as float32 (its data server reads no other type): a value reads back as `float32(value)` of metrics.jsonl's.
"""

import io
import time
from numbers import Real
from pathlib import Path

from RL2.config.errors import ConfigError


def require_tensorboard() -> None:
    """Fail at start, with what to install, when `trainer.use_tensorboard=true` cannot be honoured."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"trainer.use_tensorboard=true needs the tensorboard package ({e}): run `pip install "
                          "tensorboard` (or `pip install -e '.[tensorboard]'`), or set "
                          "trainer.use_tensorboard=false") from e


class TensorBoardLog:
    """Event files in `folder`. The writer opens at the first record, so that a resume truncates the earlier
    files before the new one starts."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.writer = None

    def log(self, metrics: dict, step: int) -> None:
        """Write every numeric value of `metrics` as a scalar at `step`, then flush."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.folder))
        walltime = time.time()  # one time for the whole step, as in metrics.jsonl's one record
        for key, value in metrics.items():
            if isinstance(value, Real):
                self.writer.add_scalar(key, value, step, walltime=walltime)
        self.writer.flush()

    def truncate_after(self, step: int) -> None:
        """On resume, drop every event of a later step from the existing files: a writer's `purge_step` only
        asks readers to hide them; rewriting the files keeps them out of every reader (and of `wandb sync`)."""
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        from RL2.utils.logging import write_atomic  # here: RL2.utils.logging imports this module

        for path in sorted(p for p in self.folder.glob("events.out.tfevents.*") if p.suffix != ".tmp"):
            records = list(RawEventFileLoader(str(path)).Load())
            kept = [raw for raw in records if Event.FromString(raw).step <= step]
            if len(kept) == len(records):
                continue
            events = io.BytesIO()
            writer = RecordWriter(events)
            for raw in kept:
                writer.write(raw)
            write_atomic(path, events.getvalue())

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
