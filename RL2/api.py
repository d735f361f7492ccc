"""Train and evaluate from Python: `RL2.train("ppo", {...}, reward=my_reward)`, `RL2.evaluate({...})`. Overrides
are the command line's `key=value` pairs as a dict (nested dicts and dotted keys alike) or a dataclass, written as
`key=value` arguments for the command line's own parser (docs/python-api.md)."""

import atexit
import dataclasses
import importlib
import json
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from RL2.config.cli import ConfigError, parse_config
from RL2.config.eval_schema import EvalConfig
from RL2.config.ppo_schema import PPOConfig
from RL2.config.schema import DistillConfig, DPOConfig, ORPOConfig, RMConfig, SFTConfig
from RL2.evaluation.evaluator import EvalResult, Evaluator
from RL2.parallel import all_gather_objects, close_process_groups
from RL2.rollout.reward_env import check_reward_signature, reward_env
from RL2.utils.logging import is_rank0, read_jsonl

# Trainer name -> its class in RL2.trainer.<name>, imported when used; the evaluator's config is "eval".
TRAINERS = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "orpo": "ORPOTrainer", "rm": "RMTrainer",
            "distill": "DistillTrainer", "ppo": "PPOTrainer"}
SCHEMAS = {"sft": SFTConfig, "dpo": DPOConfig, "orpo": ORPOConfig, "rm": RMConfig, "distill": DistillConfig,
           "ppo": PPOConfig, "eval": EvalConfig}

Overrides = Any  # a dict (nested and/or dotted keys), a DictConfig or a dataclass instance; None: no overrides
RewardFn = Callable[[str, dict], Any]


@dataclass
class TrainResult:
    """What `RL2.train` returns (the same on every rank; fields described in docs/python-api.md)."""

    save_dir: Path
    model_path: Path | None
    models: dict[str, Path]
    metrics: dict[str, float]
    history: list[dict]
    config: DictConfig


def train(trainer: str, overrides: Overrides = None, *, reward: RewardFn | None = None) -> TrainResult:
    """Run a trainer as `python -m RL2.trainer.<trainer> key=value ...` would.

    Args:
        trainer: sft, dpo, orpo, rm, distill or ppo.
        overrides: config keys and values (see the module docstring); `--help` of the trainer's
            command line lists every key.
        reward: ppo only: a `(response, extra_info) -> float | dict` function (sync or async) that
            scores each response, used as `rollout.reward_fn` would be (which must then be unset).
    """
    if trainer not in TRAINERS:
        raise ConfigError(f"unknown trainer {trainer!r}; choose one of {', '.join(TRAINERS)}")
    cfg = build_config(trainer, overrides)
    if reward is not None and trainer != "ppo":
        raise ConfigError(f"reward= scores rollouts, which only the ppo trainer makes; drop it for {trainer}")
    env = _reward_env(reward, cfg)
    save_dir = Path(cfg.trainer.save_dir)
    metrics_file = save_dir / "metrics.jsonl"
    # A resumed run rewrites metrics.jsonl up to its checkpoint; a new one, or an evaluation, appends.
    resumes = cfg.trainer.load_ckpt_from and not cfg.trainer.eval_only
    start = 0 if resumes or not metrics_file.exists() else metrics_file.stat().st_size
    with _process_group():
        exported = _run_trainer(trainer, cfg, env)
        # Rank 0 alone writes metrics.jsonl: its history, on every rank.
        history = all_gather_objects(read_jsonl(metrics_file, start) if is_rank0() and metrics_file.exists() else [])[0]
    models = {name: save_dir / "final" / name for name in exported}
    latest = {key: value for record in history for key, value in record.items() if key != "step"}
    return TrainResult(save_dir, models.get("actor", models.get("critic")), models, latest, history, cfg)


def _run_trainer(trainer: str, cfg: DictConfig, env) -> list[str]:
    """Train; the names of the models it exports. The trainer is gone when this returns, so that the
    process group it held can be freed with it (`close_process_groups`)."""
    trainer_cls = getattr(importlib.import_module(f"RL2.trainer.{trainer}"), TRAINERS[trainer])
    run = trainer_cls(cfg, env=env) if env is not None else trainer_cls(cfg)
    try:
        run.train()
    finally:
        rollout = getattr(run, "rollout", None)
        if rollout is not None:  # launched SGLang servers stop now, not when Python exits
            rollout.shutdown()
    return [] if cfg.trainer.eval_only else [name for name in run.workers() if name != "ref"]


def evaluate(overrides: Overrides = None, *, reward: RewardFn | None = None) -> EvalResult:
    """Run the evaluator as `python -m RL2.evaluate key=value ...` would, and print its table (rank 0). `overrides`:
    config keys and values (e.g. `model.model_name`, `data.test.path`, `compare.model_name`); `reward`: as `train`'s."""
    cfg = build_config("eval", overrides)
    env = _reward_env(reward, cfg)
    with _process_group():
        return Evaluator(cfg, env=env).run()


def build_config(name: str, overrides: Overrides = None) -> DictConfig:
    """The config `train(name, overrides)` (or `evaluate(overrides)` for name "eval") runs with."""
    if name not in SCHEMAS:
        raise ConfigError(f"unknown trainer {name!r}; choose one of {', '.join(SCHEMAS)}")
    return parse_config(SCHEMAS[name], name, override_args(overrides))


def override_args(overrides: Overrides) -> list[str]:
    """`key=value` command-line arguments saying what `overrides` says, each value written as YAML, which the
    command line's parser reads back as the same value (a string stays a string even when it looks like a number,
    `null` or `true`)."""
    if overrides is None:
        return []
    if dataclasses.is_dataclass(overrides) and not isinstance(overrides, type):
        overrides = dataclasses.asdict(overrides)
    elif isinstance(overrides, DictConfig):
        overrides = OmegaConf.to_container(overrides)
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides must be a dict of config keys (or a dataclass), not {type(overrides).__name__}")
    args = {}
    for key, value in _leaves(overrides):
        if key in args:
            raise ConfigError(f"config key '{key}' is given twice in the overrides (nested and dotted); keep one")
        args[key] = _yaml(value, key)
    return [f"{key}={value}" for key, value in args.items()]


def _leaves(overrides: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf; a nested dict or dataclass is a section."""
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise ConfigError(f"config keys are strings; got {key!r} under '{prefix or '(top)'}'")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _yaml(value: Any, key: str) -> str:
    """`value` as YAML flow text (JSON is YAML, but for the floats JSON has no words for)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is None or isinstance(value, (bool, str)):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isnan(value):
            return ".nan"
        return repr(value) if math.isfinite(value) else (".inf" if value > 0 else "-.inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(item, key) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_yaml(v, key)}" for k, v in value.items()) + "}"
    raise ConfigError(f"config key '{key}': cannot pass a {type(value).__name__} ({value!r}); give a number, "
                      f"string, bool, None, or a list or dict of those")


def _reward_env(reward: RewardFn | None, cfg: DictConfig):
    """The environment scoring responses with `reward`, or None (the config's own environment)."""
    if reward is None:
        return None
    if not callable(reward):
        raise ConfigError(f"reward= must be a function (response, extra_info) -> float | dict, not a "
                          f"{type(reward).__name__}; a file goes in rollout.reward_fn")
    if cfg.rollout.reward_fn:
        raise ConfigError(f"reward= and rollout.reward_fn={cfg.rollout.reward_fn} both give the reward; keep one")
    name = f"reward={getattr(reward, '__qualname__', type(reward).__name__)}"
    check_reward_signature(reward, name)
    return reward_env(reward, name=name)


_a_call_failed = False  # then the group made under torchrun is only forgotten at exit (close_process_groups)


@contextmanager
def _process_group():
    """Run the call in a process group: in a plain Python process (no RANK in the environment), a one-rank group
    destroyed when the call returns, with the variables that described it. Under torchrun the group the first call
    makes stays for the next calls and is destroyed at exit: torchrun's store keeps the keys of a destroyed group,
    which a new group (whose keys restart from the same names) would read."""
    global _a_call_failed
    unset = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
             if name not in os.environ]
    made_here = not dist.is_initialized()
    finished = False
    try:
        yield
        finished = True
    finally:
        _a_call_failed |= not finished
        if made_here and dist.is_initialized():
            if "RANK" in unset:
                close_process_groups(finished)
            else:
                atexit.register(_close_at_exit)
        for name in unset:
            os.environ.pop(name, None)


def _close_at_exit() -> None:
    # An exception that ended the script (Python keeps it for the exit handlers) may have left collectives
    # of the script's own queued: then the group is only forgotten, as after a failed call.
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    close_process_groups(finished=not _a_call_failed and uncaught is None)

