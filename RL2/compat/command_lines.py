"""What a command line written for RL2's original releases means here, beyond the new names of its keys.

A command line that uses a key only the original had (`RL2.compat.aliases.Translation.original`:
`train_data.path`, `rollout.train.*`, `actor.use_liger_kernel`, `actor=fsdp`, ...) was written for the original. A
few keys it shares with RL2 meant something else there; on such a line they keep the original's meaning, with a
printed line for each (`original_meanings`):

- `actor.update_per_rollout=N`: one pass over the rollout in N optimizer steps (here: N passes), which is
  `mini_batch_size` = batch / N, for the critic too (its value followed the actor's);
- `adv.global_norm=true` with `adv.estimator=reinforce` (grpo here), and one response per prompt: the batch's mean
  score is every response's baseline, `adv.baseline=batch` (here global_norm whitens the advantages);
- `adv.estimator=gae`: the advantages whitened over the batch, as the original always did
  (`adv.global_norm=true`);
- `rollout.dynamic_filtering=true`: groups whose rewards are all equal are dropped, not replaced by more
  prompts (`rollout.max_sampling_rounds=1`);
- `actor.kl.type` without an estimator: that place's original default, k1 in the reward and k2 in the loss;
- the test split's keys the line leaves out follow the train split's, and the critic's the actor's
  (`FOLLOWS`).

RL2's defaults stay; one printed line names those that differ from the original's where the line leaves
them out (`defaults_note`).
"""

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

# What took another key's value in the original's config unless the line gave one: {what: [(key, from key)]}.
FOLLOWS = {
    "the test split follows the train split's settings": [
        *[(f"data.test.{key}", f"data.train.{key}") for key in ("apply_chat_template", "prompt_key", "messages_key",
                                                               "response_key", "chosen_key", "rejected_key",
                                                               "max_length")],
        *[(f"rollout.test_sampling_params.{key}", f"rollout.train_sampling_params.{key}")
          for key in ("max_new_tokens", "stop", "no_stop_trim")]],
    "the critic follows the actor's settings": [(f"critic.{key}", f"actor.{key}") for key in (
        "cp_size", "tp_size", "ddp_size", "enable_gradient_checkpointing", "max_grad_norm", "offload_optimizer",
        "avg_level", "optimizer.weight_decay", "scheduler.name", "scheduler.warmup_ratio")],
}

ORIGINAL_KL_ESTIMATORS = {"reward": "k1", "loss": "k2"}  # the original's kl.reward_estimator, kl.loss_estimator

# The defaults of the original's 0.0.2 release that RL2's differ from, by trainer (keys under RL2's names).
_TRAINING = {"optimizer.weight_decay": 0.01, "scheduler.warmup_ratio": 0.1, "enable_gradient_checkpointing": True,
             "offload_optimizer": True}
ORIGINAL_DEFAULTS = {
    "ppo": {"rollout.responses_per_prompt": 1, "rollout.dynamic_filtering": True, "trainer.use_wandb": True,
            **{f"actor.{k}": v for k, v in _TRAINING.items()}},
    "sft": {"data.train.batch_size": 128, "actor.optimizer.lr": 5e-6, "actor.scheduler.name": "cosine",
            "trainer.use_wandb": True, **{f"actor.{k}": v for k, v in _TRAINING.items()}},
    "dpo": {"data.train.batch_size": 128, "actor.optimizer.lr": 5e-7, "actor.scheduler.name": "cosine",
            "trainer.use_wandb": True, **{f"actor.{k}": v for k, v in _TRAINING.items()}},
    "rm": {"data.train.batch_size": 128, "critic.optimizer.lr": 1e-5, "critic.scheduler.name": "cosine",
           "trainer.use_wandb": True, **{f"critic.{k}": v for k, v in _TRAINING.items()}},
}
_ABSENT = object()


def original_meanings(cfg: DictConfig, given: set[str], kl_estimators: bool, trainer: str) -> list[str]:
    """Give a command line written for the original the original's meaning of the keys it shares with RL2;
    one line per change to print, and the line of `defaults_note`.

    Args:
        cfg: the merged config, changed in place.
        given: the keys the command line sets, under their current or an original name.
        kl_estimators: whether the line gave an original per-place KL estimator (`kl.reward_estimator`, ...).
        trainer: the trainer's name ("ppo", "sft", ...).
    """
    lines = []
    if "adv" in cfg:
        lines += _updates(cfg, given) + _advantages(cfg, given) + _filtering(cfg, given)
        lines += _kl_estimator(cfg, given, kl_estimators)
    lines += _followers(cfg, given)
    if note := defaults_note(cfg, given, trainer):
        lines.append(note)
    return lines


def _updates(cfg, given: set[str]) -> list[str]:
    n = cfg.actor.update_per_rollout
    if "actor.update_per_rollout" not in given or n == 1 or "actor.mini_batch_size" in given:
        return []
    size = math.ceil(cfg.data.train.batch_size / n)
    models = ["actor"] + ([] if {"critic.update_per_rollout", "critic.mini_batch_size"} & given else ["critic"])
    for model in models:
        cfg[model].mini_batch_size, cfg[model].update_per_rollout = size, 1
    return [f"config key 'actor.update_per_rollout={n}' keeps the original's meaning, one pass over each rollout in "
            f"{n} optimizer steps: {' and '.join(models)} mini_batch_size={size} (of data.train.batch_size="
            f"{cfg.data.train.batch_size} prompts), update_per_rollout=1 (here it counts passes)"]


def _advantages(cfg, given: set[str]) -> list[str]:
    adv, lines = cfg.adv, []
    one_response = cfg.rollout.responses_per_prompt == 1
    if adv.estimator == "grpo" and "adv.baseline" not in given and (one_response or (
            adv.global_norm and "adv.global_norm" in given)):
        why = "rollout.responses_per_prompt=1" if one_response else "adv.global_norm=true"
        adv.baseline, adv.global_norm = "batch", False
        lines.append(f"{why} keeps the original's meaning: the batch's mean score is every response's baseline "
                     f"(adv.baseline=batch, adv.global_norm=false; here global_norm whitens the advantages)")
    if adv.estimator == "gae" and not adv.global_norm:
        adv.global_norm = True
        lines.append("adv.estimator=gae: the advantages are whitened over the batch (adv.global_norm=true), as the "
                     "original always did")
    return lines


def _filtering(cfg, given: set[str]) -> list[str]:
    rollout = cfg.rollout
    if not (rollout.dynamic_filtering and "rollout.dynamic_filtering" in given) or (
            "rollout.max_sampling_rounds" in given or rollout.max_sampling_rounds == 1):
        return []
    rollout.max_sampling_rounds = 1
    return ["rollout.dynamic_filtering=true keeps the original's meaning: groups whose rewards are all equal are "
            "dropped, not replaced by more prompts (rollout.max_sampling_rounds=1)"]


def _kl_estimator(cfg, given: set[str], kl_estimators: bool) -> list[str]:
    kl = cfg.actor.kl
    if "actor.kl.type" not in given or kl_estimators or "actor.kl.estimator" in given:
        return []
    kl.estimator = ORIGINAL_KL_ESTIMATORS[kl.type]
    return [f"actor.kl.type={kl.type} without an estimator takes the original's default for the {kl.type}: "
            f"actor.kl.estimator={kl.estimator}"]


def _followers(cfg, given: set[str]) -> list[str]:
    lines = []
    for what, pairs in FOLLOWS.items():
        followed = []
        for key, leader in pairs:
            value = OmegaConf.select(cfg, leader, default=_ABSENT)
            if value is _ABSENT or leader not in given or key in given or (
                    OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT):  # the trainer has no such key
                continue
            if OmegaConf.select(cfg, key) != value:
                OmegaConf.update(cfg, key, value, merge=False)
                followed.append(f"{key}={as_text(value)}")
        if followed:
            lines.append(f"{what}, as in the original: {', '.join(followed)}")
    return lines


def defaults_note(cfg, given: set[str], trainer: str) -> str | None:
    """One line naming RL2's defaults that differ from the original's (`ORIGINAL_DEFAULTS`) for the keys the
    command line leaves out, or None."""
    differ = [f"{key}={as_text(OmegaConf.select(cfg, key))} (original: {as_text(value)})"
              for key, value in ORIGINAL_DEFAULTS.get(trainer, {}).items()
              if key not in given and OmegaConf.select(cfg, key) != value]
    if not differ:
        return None
    return (f"RL2's defaults differ from the original's for keys this command line leaves out: {', '.join(differ)}; "
            f"set them to train as the original did")


def as_text(value: Any) -> str:
    """A value as command-line text (`true`, `null`, `['a', 'b']`: OmegaConf reads a list's quoted items back)."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
