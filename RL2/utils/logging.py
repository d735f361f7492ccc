"""Rank-aware printing and the one metrics sink: JSONL always, wandb and TensorBoard when asked."""

import json
import os
from pathlib import Path

import torch.distributed as dist

from RL2.utils.tensorboard import TensorBoardLog, require_tensorboard


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_rank0(message: str) -> None:
    if is_rank0():
        print(f"[RL2] {message}", flush=True)


class MetricsSink:
    """Appends one JSON object per step to `<save_dir>/metrics.jsonl`; forwards to wandb and to
    TensorBoard event files in `<save_dir>/tensorboard` if enabled.

    Only rank 0 writes. wandb honours WANDB_MODE; without credentials it runs offline rather than
    waiting for a login prompt.

    Args:
        save_dir: the run folder.
        use_wandb: also log to wandb.
        project, name: the wandb project and run names.
        config: the run's config, recorded by wandb.
        use_tensorboard: also write TensorBoard event files (needs the `tensorboard` package).
    """

    def __init__(self, save_dir: str, use_wandb: bool = False, project: str = "RL2", name: str = "run", config=None,
                 use_tensorboard: bool = False):
        if use_tensorboard:
            require_tensorboard()  # on every rank, so that all of them stop
        self.enabled = is_rank0()
        self.path = Path(save_dir) / "metrics.jsonl"
        self.wandb = None
        self.tensorboard = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if use_wandb and os.environ.get("WANDB_MODE") != "disabled":
            self.wandb = _init_wandb(project, name, save_dir, config)
        if use_tensorboard:
            self.tensorboard = TensorBoardLog(Path(save_dir) / "tensorboard")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        values = {k: _plain(v) for k, v in metrics.items()}
        record = {"step": step, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(record, step=step)
        if self.tensorboard is not None:
            self.tensorboard.log(values, step)

    def truncate_after(self, step: int) -> None:
        """On resume, drop records of steps that the resumed run will redo.

        A line that is not a whole JSON record is what a crash mid-write leaves; it is dropped too. The
        file is replaced in one rename, so a crash here leaves either the old file or the new one.
        """
        if not self.enabled:
            return
        if self.tensorboard is not None:
            self.tensorboard.truncate_after(step)
        if not self.path.exists():
            return
        kept, torn = [], 0
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                torn += 1
                continue
            if record["step"] <= step:
                kept.append(line)
        if torn:
            log_rank0(f"{self.path}: dropped {torn} incomplete line(s) left by an interrupted run")
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _init_wandb(project: str, name: str, save_dir: str, config):
    import wandb
    from omegaconf import OmegaConf

    mode = os.environ.get("WANDB_MODE")
    if mode is None and not (os.environ.get("WANDB_API_KEY") or _has_netrc_login()):
        log_rank0("wandb: no login found, logging offline (set WANDB_API_KEY or WANDB_MODE=online to sync)")
        mode = "offline"
    plain_config = OmegaConf.to_container(config, resolve=True) if config is not None else None
    return wandb.init(project=project, name=name, dir=save_dir, config=plain_config, mode=mode)


def _has_netrc_login() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text()


def _plain(value):
    return value.item() if hasattr(value, "item") else value
