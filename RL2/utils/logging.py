"""Rank-aware printing, durable file writes and the metrics sink: JSONL always, wandb and TensorBoard if asked."""

import importlib.util
import json
import os
from pathlib import Path

import torch.distributed as dist

from RL2.config.errors import ConfigError
from RL2.utils.tensorboard import TensorBoardLog, require_tensorboard


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_rank0(message: str) -> None:
    if is_rank0():
        print(f"[RL2] {message}", flush=True)


def make_save_dir(save_dir: str | Path) -> None:
    """Create `trainer.save_dir` (and its parents) or raise a ConfigError saying why it cannot be."""
    try:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only place, or a file where a folder of the path should be
        raise ConfigError(f"trainer.save_dir={save_dir}: cannot create it ({e.strerror}: {e.filename}); give a "
                          f"folder this user can write") from None


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line, on a line of its own even after a run that was killed mid-line."""
    with open(path, "ab+") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(record) + "\n").encode())


def read_jsonl(path: Path, start: int = 0) -> list[dict]:
    """The JSON records of a file from byte `start` on; a line that is not one whole record (a killed run's
    last) is skipped."""
    with open(path, "rb") as f:
        f.seek(start)
        return [record for record in map(json_record, f.read().decode().splitlines()) if record is not None]


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` and fsync the file."""
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace `path` (and make its folder) atomically and durably: readers see the old file or the new one,
    never a half-written one, and after a power loss the new one if this returned."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def truncate_jsonl_after(path: Path, step: int) -> None:
    """Keep the records of steps up to `step` (a resume redoes the later ones), and only whole lines."""
    path = Path(path)
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = [(line, json_record(line)) for line in lines]
    if any(record is None for _, record in records):
        log_rank0(f"{path}: dropped the incomplete lines an interrupted run left")
    kept = [line for line, record in records if record is not None and record["step"] <= step]
    write_atomic(path, "".join(line + "\n" for line in kept))


def json_record(line: str) -> dict | None:
    """The JSON object on one line of a JSONL file, or None for a line that is not one whole object."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


class MetricsSink:
    """Appends one JSON object per step to `<save_dir>/metrics.jsonl`; forwards to wandb and TensorBoard if
    enabled. Only rank 0 writes; without credentials wandb runs offline rather than wait for a login prompt."""

    def __init__(self, save_dir: str, use_wandb: bool = False, project: str = "RL2", name: str = "run", config=None,
                 use_tensorboard: bool = False):
        if use_tensorboard:
            require_tensorboard()  # on every rank, so that all of them stop
        use_wandb = use_wandb and os.environ.get("WANDB_MODE") != "disabled"
        if use_wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError("trainer.use_wandb=true needs the wandb package: run `pip install wandb`, or set "
                              "trainer.use_wandb=false (trainer.use_tensorboard=true logs without an account)")
        self.enabled = is_rank0()
        self.path = Path(save_dir) / "metrics.jsonl"
        make_save_dir(save_dir)  # on every rank (they all write checkpoints there), so that all of them stop
        self.wandb = _init_wandb(project, name, save_dir, config) if self.enabled and use_wandb else None
        self.tensorboard = TensorBoardLog(Path(save_dir) / "tensorboard") if self.enabled and use_tensorboard else None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        values = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}  # tensors as numbers
        record = {"step": step, **values}
        append_jsonl(self.path, record)
        if self.wandb is not None:
            self.wandb.log(record, step=step)
        if self.tensorboard is not None:
            self.tensorboard.log(values, step)

    def truncate_after(self, step: int) -> None:
        """On resume, drop records of steps that the resumed run will redo."""
        if not self.enabled:
            return
        if self.tensorboard is not None:
            self.tensorboard.truncate_after(step)
        truncate_jsonl_after(self.path, step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _init_wandb(project: str, name: str, save_dir: str, config):
    import wandb
    from omegaconf import OmegaConf

    from RL2.utils.redaction import redact_config

    mode, netrc = os.environ.get("WANDB_MODE"), Path.home() / ".netrc"
    if mode is None and not (os.environ.get("WANDB_API_KEY") or
                             (netrc.exists() and "api.wandb.ai" in netrc.read_text())):
        log_rank0("wandb: no login found, logging offline (set WANDB_API_KEY or WANDB_MODE=online to sync)")
        mode = "offline"
    plain_config = redact_config(OmegaConf.to_container(config, resolve=True)) if config is not None else None
    return wandb.init(project=project, name=name, dir=save_dir, config=plain_config, mode=mode)
