"""The table of RL2's original config keys: what each one is called now, or why RL2 has no such key.

Collected from the configs (`RL2/trainer/config/*.yaml`) and example command lines of RL2's
original releases. `RL2.compat.aliases` applies the table to a command line.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MODELS = ("actor", "critic")  # "{model}" in a table key stands for each


@dataclass(frozen=True)
class Renamed:
    """An original key and the current key(s) it sets. A key ending in "." renames every key under it."""

    old: str
    new: tuple[str, ...]
    value: Callable[[Any], Any] | None = None  # the original value -> the current one (None: the same)


@dataclass(frozen=True)
class Dropped:
    """An original key for something RL2 does not have; `instead` says what to do."""

    old: str
    instead: str


@dataclass(frozen=True)
class Ignored:
    """An original key for a memory or speed switch RL2 has no counterpart of, which changes nothing that is
    trained: accepted, and `why` printed."""

    old: str
    why: str


@dataclass(frozen=True)
class LoRASwitch:
    """The original `{model}.use_lora`: here LoRA is on when `{model}.lora.rank` > 0, so `true` sets the
    original's default rank unless a rank is given (`RL2.compat.aliases.apply_lora_switches`)."""

    old: str
    model: str


ORIGINAL_LORA_RANK = 16  # the original's default `lora.r`
MEGATRON = ("RL2 trains with FSDP2 only (the original's Megatron backend is not here): drop it; actor.tp_size, "
            "actor.cp_size and actor.ddp_size set the layout")
# The original's config groups (`actor=fsdp`, `critic=megatron`, written without a dot) and what each choice
# means here: None is RL2's own backend, accepted; a string is why the choice fails.
BACKENDS = {"fsdp": None, "megatron": MEGATRON}


@dataclass(frozen=True)
class KLEstimator:
    """The original per-place KL estimator keys (`place` is "reward" or "loss")."""

    old: str
    place: str


def _scheduler_name(name: Any) -> Any:
    # transformers' schedule names, which the original passed to `get_scheduler`
    return {"cosine_with_min_lr": "cosine", "constant_with_warmup": "constant"}.get(name, name)


def _avg_level(mode: Any) -> Any:
    # agg_mode's names over its releases: token_mean/seq_mean, then all_token_mean/seq_mean_seq_token_mean
    return {"token_mean": "token", "all_token_mean": "token", "seq_mean": "sequence",
            "seq_mean_seq_token_mean": "sequence"}.get(mode, mode)


def _as_list(value: Any) -> Any:
    # The original passed target_modules to peft, which takes one string ("all-linear") or a list.
    return [value] if isinstance(value, str) else value


def _tis_coef(coef: Any) -> Any:
    # The original applied truncated importance sampling only when tis_coef > 0; RL2's off is null.
    return None if isinstance(coef, (int, float)) and coef <= 0 else coef


def _negate(flag: Any) -> Any:
    if not isinstance(flag, bool):
        raise ValueError(f"expected true or false, got {flag!r}")
    return not flag


def _both_splits(old: str, key: str) -> Renamed:
    return Renamed(old, (f"data.train.{key}", f"data.test.{key}"))


_SPLIT_KEYS = ("prompt_key", "response_key", "messages_key", "chosen_key", "rejected_key", "apply_chat_template")
# the original's sections of a split's RL data, over its releases, and the split each one is
_SPLITS = (("train_data", "train"), ("test_data", "test"), ("rollout.train", "train"), ("rollout.test", "test"))
_PER_MODEL = [
    Renamed("{model}.lr", ("{model}.optimizer.lr",)),
    Renamed("{model}.weight_decay", ("{model}.optimizer.weight_decay",)),
    # the original's sequence parallelism was ring attention over the sequence: context parallelism
    Renamed("{model}.sp_size", ("{model}.cp_size",)),
    Renamed("{model}.gradient_checkpointing", ("{model}.enable_gradient_checkpointing",)),
    Renamed("{model}.warmup_ratio", ("{model}.scheduler.warmup_ratio",)),
    Renamed("{model}.scheduler", ("{model}.scheduler.name",), _scheduler_name),  # a string in the original
    Renamed("{model}.scheduler.name", ("{model}.scheduler.name",), _scheduler_name),
    Renamed("{model}.agg_mode", ("{model}.avg_level",), _avg_level),
    Renamed("{model}.save_freq", ("trainer.save_freq",)),
    Renamed("{model}.save_dir", ("trainer.save_dir",)),
    Ignored("{model}.max_inference_length_per_device",
            "RL2 packs every pass, with or without gradients, into {model}.max_length_per_device tokens per rank"),
    Ignored("{model}.use_liger_kernel", "RL2 has no Liger kernels; the loss and its gradient are the same without "
                                        "them"),
    Ignored("{model}.offload_model", "RL2 keeps the model on its device ({model}.offload_optimizer=true moves the "
                                     "optimizer state off it)"),
    LoRASwitch("{model}.use_lora", "{model}"),
    Renamed("{model}.lora.r", ("{model}.lora.rank",)),
    Renamed("{model}.lora.lora_alpha", ("{model}.lora.alpha",)),
    Renamed("{model}.lora.lora_dropout", ("{model}.lora.dropout",)),
    Renamed("{model}.lora.target_modules", ("{model}.lora.target_modules",), _as_list),
    Dropped("{model}.lora.use_rslora", "RL2 scales adapters by {model}.lora.alpha / rank; for rsLoRA's alpha / "
                                       "sqrt(rank) set {model}.lora.alpha to alpha x sqrt(rank) and drop use_rslora"),
    Dropped("{model}.backend", "RL2 has one training backend, FSDP2; drop it"),
    *[Dropped(f"{{model}}.{key}", MEGATRON) for key in ("tf_config.", "ddp_config.", "optimizer.min_lr",
                                                       "optimizer.clip_grad", "scheduler.lr_decay_style")],
    Dropped("{model}.fsdp_size", "set {model}.ddp_size (replicas) instead: FSDP shards over the rest, so "
                                 "ddp_size = world size / fsdp_size"),
    Dropped("{model}.load_ckpt", "resume with trainer.load_ckpt_from=latest or a step<N> folder"),
    Dropped("{model}.optimizer_dir", "resume with trainer.load_ckpt_from=latest or a step<N> folder"),
    Dropped("{model}.save_optimizer", "RL2's checkpoints always hold the optimizer state"),
]
_KL = [
    Renamed("kl.", ("actor.kl.",)),  # the original README writes the KL switches without `actor.`
    KLEstimator("actor.kl.reward_estimator", "reward"),
    KLEstimator("actor.kl.loss_estimator", "loss"),
]
_ACTOR = [
    Renamed("actor.tis_coef", ("actor.tis_coef",), _tis_coef),
    Renamed("critic.clip", ("critic.value_clip",)),
    Renamed("trainer.beta", ("actor.beta",)),
    Dropped("actor.ref_model_name", "the reference is the actor's initial weights (actor.model_name)"),
    Dropped("ref_actor.model_name", "the reference is the actor's initial weights (actor.model_name); drop it"),
    Ignored("ref_actor.", "the reference is the actor's initial weights and follows actor.* (dtype, layout, "
                          "temperature)"),
]
_DATA = [
    Renamed("data.path", ("data.train.path",)),
    Renamed("data.train_data_path", ("data.train.path",)),
    Renamed("data.test_data_path", ("data.test.path",)),
    Renamed("data.batch_size", ("data.train.batch_size",)),
    Renamed("data.prompts_per_rollout", ("data.train.batch_size",)),
    Renamed("data.responses_per_prompt", ("rollout.responses_per_prompt",)),
    _both_splits("data.max_length", "max_length"),
    *[_both_splits(f"data.{key}", key) for key in _SPLIT_KEYS],
    Ignored("data.batch_size_per_device", "RL2 packs micro-batches by tokens (<model>.max_length_per_device); the "
                                          "optimizer step still takes data.train.batch_size examples"),
]
_RL_SPLITS = [  # the original's per-split RL data sections
    # November 2025 kept a split's sampling under `experience`
    *[Renamed(f"{split}.experience.", (f"{split}.",)) for split in ("train_data", "test_data")],
    *[Renamed(f"{old}.path", (f"data.{new}.path",)) for old, new in _SPLITS],
    *[Renamed(f"{old}.prompts_per_rollout", ("data.train.batch_size",)) for old in ("train_data", "rollout.train")],
    Renamed("rollout.train_prompts_per_rollout", ("data.train.batch_size",)),
    *[Renamed(f"{old}.responses_per_prompt", ("rollout.responses_per_prompt",))
      for old in ("train_data", "rollout.train")],
    *[Renamed(f"{old}.responses_per_prompt", ("rollout.test_responses_per_prompt",))
      for old in ("test_data", "rollout.test")],
    *[Renamed(f"{old}.sampling_params.", (f"rollout.{new}_sampling_params.",)) for old, new in _SPLITS],
    Renamed("train_data.max_new_tokens", ("rollout.train_sampling_params.max_new_tokens",)),
    Renamed("test_data.max_new_tokens", ("rollout.test_sampling_params.max_new_tokens",)),
    *[Renamed(f"{old}.max_turns", ("rollout.max_turns",)) for old in ("train_data", "rollout.train")],
    *[Renamed(f"{old}.{key}", (f"data.{new}.{key}",)) for old, new in _SPLITS
      for key in ("prompt_key", "messages_key", "apply_chat_template")],
    Renamed("rollout.train.dynamic_filtering", ("rollout.dynamic_filtering",)),
    Renamed("rollout.train.partial_rollout", ("rollout.partial_rollout",)),
    Renamed("rollout.test_ratio", ("data.test_ratio",)),
    _both_splits("rollout.apply_chat_template", "apply_chat_template"),
    *[Renamed(f"{old}.prompts_per_rollout", ("rollout.test_prompts_per_rollout",))
      for old in ("test_data", "rollout.test")],
    *[Dropped(key, "rollout.save_samples=true writes every trajectory to <trainer.save_dir>/samples.jsonl")
      for key in ("rollout.train.save_dir", "rollout.test.save_dir")],
]
_ROLLOUT = [
    Renamed("actor.rollout.", ("rollout.",)),  # the first releases kept the rollout under the actor
    Renamed("actor.rollout.n_turns", ("rollout.max_turns",)),
    Renamed("actor.rollout.train_temperature", ("rollout.train_sampling_params.temperature",)),
    Renamed("actor.rollout.test_temperature", ("rollout.test_sampling_params.temperature",)),
    Renamed("actor.rollout.max_response_length", ("rollout.train_sampling_params.max_new_tokens",
                                                  "rollout.test_sampling_params.max_new_tokens")),
    Dropped("actor.rollout.reward_fn_path", "its reward_fn(messages, answer) becomes rollout.reward_fn=FILE:NAME with "
                                            "def NAME(response, extra_info) (the answer is extra_info['answer'])"),
    *[Dropped(f"actor.rollout.{key}", "RL2 scores with an environment script: rollout.env_path=FILE defining "
                                      "`async def step(state, action, extra_info)`")
      for key in ("env_url", "tool_path")],
    Ignored("actor.rollout.multi_thread_scoring", "environment steps run concurrently, on a thread of their own"),
    Renamed("rollout.tp_size", ("rollout.server_args.tp_size",)),
    Renamed("rollout.gpu_memory_utilization", ("rollout.server_args.mem_fraction_static",)),
    Renamed("rollout.dtype", ("rollout.server_args.dtype",)),
    Renamed("rollout.bucket_size", ("rollout.weight_bucket_mb",)),
    Dropped("rollout.model_name", "the engines run the actor's weights (actor.model_name)"),
    # The model the original's servers ran (the actor's unless set): here the engines run the actor's weights.
    Renamed("rollout.server_args.model_path", ("actor.model_name",)),
    Ignored("rollout.base_port", "RL2 picks free ports for the servers it launches"),
    Dropped("rollout.group_filtering.",
            "use rollout.dynamic_filtering=true (drops groups whose rewards are all equal)"),
]
_TRAINER = [
    Renamed("trainer.disable_wandb", ("trainer.use_wandb",), _negate),
    Renamed("trainer.load_ckpt_from_dir", ("trainer.load_ckpt_from",)),
    Dropped("trainer.fsdp_size", "set actor.ddp_size (replicas) instead: FSDP shards over the rest"),
]


def _expand(entry):
    """An entry of `_PER_MODEL` once per model section: "{model}" filled in each of its texts."""
    if "{model}" not in entry.old:
        return [entry]

    def filled(value, model: str):
        if isinstance(value, tuple):
            return tuple(filled(v, model) for v in value)
        return value.format(model=model) if isinstance(value, str) else value

    return [dataclasses.replace(entry, **{f.name: filled(getattr(entry, f.name), model)
                                          for f in dataclasses.fields(entry)}) for model in MODELS]


ALIASES = [expanded for entry in _PER_MODEL + _KL + _ACTOR + _DATA + _RL_SPLITS + _ROLLOUT + _TRAINER
           for expanded in _expand(entry)]
