"""What a command line written for RL2's original releases means here, beyond the new names of its keys
(`RL2.compat.aliases` renames them into a `Translation`, whose `apply` does the rest once it is merged).

A command line that uses a key only the original had (`Translation.original`: `train_data.path`,
`rollout.train.*`, `actor.use_liger_kernel`, `actor=fsdp`, ...) was written for the original. A few keys
it shares with RL2 meant something else there; on such a line they keep the original's meaning, with a
printed line for each (`apply_original_meanings`):

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
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from RL2.compat.keys import ORIGINAL_LORA_RANK
from RL2.config.errors import ConfigError

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


@dataclass
class Translation:
    """A command line with RL2's original keys replaced by the current ones."""

    argv: list[str] = field(default_factory=list)  # `key=value` arguments with current keys only
    lines: list[str] = field(default_factory=list)  # one per alias used, naming the current key (printed on rank 0)
    # place ("reward" | "loss") -> (original key, estimator): `apply_kl_estimators` takes actor.kl.type's
    kl_estimators: dict[str, tuple[str, str]] = field(default_factory=dict)
    # model section -> (original key, value) of `{model}.use_lora`: `apply_lora_switches` sets the rank
    lora_switches: dict[str, tuple[str, str]] = field(default_factory=dict)
    explicit: set[str] = field(default_factory=set)  # current keys given under their current name
    given: set[str] = field(default_factory=set)  # current keys the line sets, under their current or an original name
    # The keys only RL2's original releases had: when there is any, the line was written for the original, and
    # `apply_original_meanings` gives the keys it shares with RL2 the original's meaning.
    original: list[str] = field(default_factory=list)

    def apply(self, cfg: DictConfig, trainer: str) -> None:
        """What the line means once merged into the config `cfg` of `trainer` (changed in place, adding to `lines`)."""
        apply_kl_estimators(cfg, self)
        apply_lora_switches(cfg, self)
        apply_original_meanings(cfg, self, trainer)


def apply_kl_estimators(cfg: DictConfig, translation: Translation) -> None:
    """The original README's switches parse as written ("To use OpenAI PPO, set `kl.type=reward`,
    `kl.reward_estimator=k1`, and `adv.estimator=gae`"): the original had one KL estimator per place; RL2's one
    `actor.kl.estimator` takes the estimator of the place `actor.kl.type` puts the KL in."""
    place = cfg.actor.kl.type if translation.kl_estimators else None
    for other, (key, value) in translation.kl_estimators.items():
        if other != place:
            translation.lines.append(
                f"config key '{key}={value}' (RL2's original name) is not used: actor.kl.type={place} puts the KL "
                f"in the {place}, whose estimator is actor.kl.estimator")
    if place not in translation.kl_estimators:
        return
    key, value = translation.kl_estimators[place]
    estimator = parse_value(value, key)
    if "actor.kl.estimator" in translation.explicit and cfg.actor.kl.estimator != estimator:
        raise ConfigError(f"config keys '{key}={value}' and 'actor.kl.estimator={cfg.actor.kl.estimator}' disagree; "
                          f"keep actor.kl.estimator")
    cfg.actor.kl.estimator = estimator
    translation.lines.append(f"config key '{key}={value}' (RL2's original name) is now 'actor.kl.estimator={value}': "
                             f"actor.kl.type={place} puts the KL in the {place}")


def apply_lora_switches(cfg: DictConfig, translation: Translation) -> None:
    """The original `{model}.use_lora`: false sets `{model}.lora.rank=0`; true keeps a rank given (the
    original `{model}.lora.r`) or sets the original's default rank."""
    for model, (key, raw) in translation.lora_switches.items():
        on, rank_key, lora = parse_value(raw, key), f"{model}.lora.rank", cfg[model].lora
        if not isinstance(on, bool):
            raise ConfigError(f"config key '{key}': expected true or false, got {raw!r}")
        if on and lora.rank == 0 and rank_key in translation.explicit:
            raise ConfigError(f"config keys '{key}=true' and '{rank_key}=0' disagree; LoRA is on when {rank_key} > 0")
        if not on:
            lora.rank = 0
        elif lora.rank == 0:
            lora.rank = ORIGINAL_LORA_RANK
        default = " (the original's default lora.r)" if on and lora.rank == ORIGINAL_LORA_RANK else ""
        translation.lines.append(
            f"config key '{key}={raw}' (RL2's original name) is now '{rank_key}={lora.rank}'{default}")


def apply_original_meanings(cfg: DictConfig, translation: Translation, trainer: str) -> None:
    """Give a command line written for the original (`translation.original` not empty) the original's
    meaning of the keys it shares with RL2, adding one line per change to `translation.lines`, and the
    line of `defaults_note`.

    Args:
        cfg: the merged config, changed in place.
        translation: the command line's translation.
        trainer: the trainer's name ("ppo", "sft", ...).
    """
    if not translation.original:
        return
    given, lines = translation.given, translation.lines
    if "adv" in cfg:
        lines += _updates(cfg, given) + _advantages(cfg, given) + _filtering(cfg, given)
        lines += _kl_estimator(cfg, translation)
    lines += _followers(cfg, given)
    if note := defaults_note(cfg, given, trainer):
        lines.append(note)


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


def _kl_estimator(cfg, translation: Translation) -> list[str]:
    kl = cfg.actor.kl
    given = translation.given
    if "actor.kl.type" not in given or translation.kl_estimators or "actor.kl.estimator" in given:
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


def parse_value(raw: str, key: str) -> Any:
    """The value `raw` of `key` on the command line, as OmegaConf reads it."""
    try:
        return OmegaConf.from_dotlist([f"value={raw}"]).value
    except Exception as e:  # OmegaConf's grammar errors come in several types
        raise ConfigError(f"config key '{key}': cannot read the value {raw!r} ({e})") from None


def as_text(value: Any) -> str:
    """A value as command-line text (`true`, `null`, `['a', 'b']`: OmegaConf reads a list's quoted items back)."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
