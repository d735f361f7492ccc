"""Rank-aware printing and the one metrics sink: JSONL always, wandb when asked."""

import json
import os
from pathlib import Path

import torch.distributed as dist


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_rank0(message: str) -> None:
    if is_rank0():
        print(f"[RL2] {message}", flush=True)


class MetricsSink:
    """Appends one JSON object per step to `<save_dir>/metrics.jsonl`; forwards to wandb if enabled.

    Only rank 0 writes. wandb honours WANDB_MODE; without credentials it runs offline rather than
    waiting for a login prompt.
    """

    def __init__(self, save_dir: str, use_wandb: bool = False, project: str = "RL2", name: str = "run", config=None):
        self.enabled = is_rank0()
        self.path = Path(save_dir) / "metrics.jsonl"
        self.wandb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if use_wandb and os.environ.get("WANDB_MODE") != "disabled":
            self.wandb = _init_wandb(project, name, save_dir, config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(record, step=step)

    def truncate_after(self, step: int) -> None:
        """On resume, drop records of steps that the resumed run will redo."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


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
