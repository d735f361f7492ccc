"""Typed config schemas shared by every trainer: key names, types, help texts and defaults (a trainer's YAML in
`RL2/trainer/config/` holds only where its defaults differ; `RL2.config.cli` merges the three)."""

from dataclasses import dataclass, field
from typing import Any

from RL2.config.errors import require


def opt(default: Any, help: str, choices: tuple | None = None, aliases: dict[str, str] | None = None) -> Any:
    """A config field with a default, a one-line help text (`--help`), and for a field that names one of a few
    things its `choices` (any other value fails at start) and `aliases` (other spellings of a choice)."""
    metadata = {"help": help, "choices": choices, "aliases": aliases}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    if isinstance(default, type):  # a nested config: build a fresh instance each time
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class SplitConfig:
    path: str | None = opt(None, "JSON/JSONL/CSV/Parquet/Arrow file, save_to_disk folder or hub name; 'split@path' "
                           "picks a split")
    max_length: int = opt(2048, "sequences longer than this many tokens are truncated")
    batch_size: int = opt(32, "examples (prompts for RL, pairs for DPO/RM) per optimizer step, over all ranks")
    prompt_key: str = opt("prompt", "column holding the prompt (text, or a list of chat messages)")
    response_key: str = opt("response", "column holding the response text (SFT)")
    messages_key: str = opt("messages", "column holding a multi-turn conversation; loss only on assistant turns")
    tools_key: str = opt("tools", "column holding the OpenAI tool schemas an SFT conversation's tool_calls call (a "
                         "list, or its JSON text)")
    chosen_key: str = opt("chosen", "column holding the preferred response (DPO, RM)")
    rejected_key: str = opt("rejected", "column holding the dispreferred response (DPO, RM)")
    apply_chat_template: bool = opt(True, "format prompts with the tokenizer's chat template")


@dataclass
class DataConfig:
    train: SplitConfig = opt(SplitConfig, "training split")
    test: SplitConfig = opt(SplitConfig, "test split; when its path is empty, test_ratio of train is held out")
    test_ratio: float = opt(0.0, "fraction of the training set held out as the test split when data.test.path is unset "
                            "(read with data.train's keys and settings; 0: none)")
    skip_bad_rows: bool = opt(False, "skip (and count) malformed rows instead of stopping with an error")
    shuffle: bool = opt(True, "shuffle the training set every epoch (seeded by trainer.seed)")


@dataclass
class OptimizerConfig:
    lr: float = opt(1e-5, "peak learning rate of AdamW")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    betas: list[float] = opt([0.9, 0.999], "AdamW betas")
    eps: float = opt(1e-8, "AdamW epsilon")


@dataclass
class SchedulerConfig:
    name: str = opt("constant", "learning rate after warmup: constant | cosine", choices=("constant", "cosine"))
    warmup_ratio: float = opt(0.0, "fraction of total steps spent warming up linearly from 0")
    min_lr: float = opt(0.0, "floor of the cosine schedule (absolute learning rate)")


# The attention and MLP projections of Llama, Mistral, Qwen2 and Qwen3.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    rank: int = opt(0, "LoRA rank: train low-rank adapters on a frozen base model instead of every parameter (0: off)")
    alpha: float = opt(32.0, "LoRA's scale: an adapter's output is multiplied by alpha / rank")
    dropout: float = opt(0.0, "dropout on an adapter's input while training")
    target_modules: list[str] = opt(LORA_TARGETS, "linear layers of the decoder layers that get adapters, by the last "
                                    "part(s) of their module path; [all-linear] takes every one")


@dataclass
class ModelConfig:
    model_name: str = opt("smollm2-135m-instruct", "HF folder or name; 'smollm2-135m-instruct' is the bundled model")
    tokenizer_name: str | None = opt(None, "tokenizer to load; defaults to model_name")
    dtype: str = opt("auto", "compute dtype: auto (bfloat16 where its matmuls are native and faster than float32, else "
                     "float32) | bfloat16 | float16 (with a gradient scaler) | float32; master weights stay float32, "
                     "frozen models are stored in it", choices=("auto", "bfloat16", "float16", "float32"))
    max_length_per_device: int = opt(4096, "token budget of one packed micro-batch on one rank")
    enable_gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    checkpoint_every_n_layers: int = opt(1, "with enable_gradient_checkpointing: recompute every n-th decoder layer "
                                         "(1: all); the others keep their activations, trading memory for speed")
    share_prefixes: bool = opt(True, "compute a prefix that consecutive packed sequences share (a prompt and its "
                               "group's responses) once; with the SDPA attention path (CPU, or CUDA without flash "
                               "kernels), not under context parallelism")
    max_grad_norm: float = opt(1.0, "gradient clipping by global norm (<= 0 disables)")
    offload_optimizer: bool = opt(False, "keep optimizer state on CPU between steps (GPU only; no-op on CPU)")
    avg_level: str = opt("token", "loss averaging: token (over all tokens of the batch) | sequence (per sample first: "
                         "a sequence, or an RL trajectory) | constant (RL: token sum over max_new_tokens x samples, "
                         "Dr. GRPO)", choices=("token", "sequence", "constant"))
    tp_size: int = opt(1, "tensor-parallel degree")
    cp_size: int = opt(1, "context-parallel degree")
    ddp_size: int = opt(1, "replicas for hybrid sharding (replicate x shard)")
    optimizer: OptimizerConfig = opt(OptimizerConfig, "optimizer")
    scheduler: SchedulerConfig = opt(SchedulerConfig, "learning-rate scheduler")
    lora: LoRAConfig = opt(LoRAConfig, "LoRA adapters (rank > 0 turns them on; the base weights stay frozen in the "
                           "compute dtype, in float32 when PPO's reference resets merge adapters into them)")


def check_model_sections(cfg) -> None:
    """Fail on model settings that cannot train, naming the key (every model section of `cfg`)."""
    for section, value in cfg.items():
        lora = value.get("lora") if hasattr(value, "get") else None
        if lora is None:
            continue
        require(value.max_length_per_device >= 1, f"{section}.max_length_per_device={value.max_length_per_device}; it "
                f"is a micro-batch's token budget: set it at least as long as the longest sequence (data.*.max_length)")
        for degree in ("tp_size", "cp_size", "ddp_size"):
            require(value[degree] >= 1, f"{section}.{degree}={value[degree]}: a parallel degree is at least 1; set it "
                                        f"to 1 or more")
        every = value.checkpoint_every_n_layers
        require(every >= 1, f"{section}.checkpoint_every_n_layers={every}; set 1 to recompute every decoder layer, "
                            f"n > 1 for every n-th, or {section}.enable_gradient_checkpointing=false for none")
        # AdamW settings torch would refuse (or misread) when the optimizer is built.
        optimizer, key = value.optimizer, f"{section}.optimizer"
        require(min(optimizer.lr, optimizer.eps, optimizer.weight_decay) >= 0, f"{key}.lr={optimizer.lr}, eps="
                f"{optimizer.eps}, weight_decay={optimizer.weight_decay}; none of them can be negative")
        betas = list(optimizer.betas)
        require(len(betas) == 2 and all(0 <= beta < 1 for beta in betas),
                f"{key}.betas={betas}; AdamW takes two decay rates, each in [0, 1), e.g. [0.9, 0.999]")
        warmup = value.scheduler.warmup_ratio
        require(0 <= warmup <= 1, f"{section}.scheduler.warmup_ratio={warmup}; it is the fraction of the run's steps "
                                  f"spent warming up: set it in [0, 1]")
        key = f"{section}.lora"
        require(lora.rank >= 0, f"{key}.rank={lora.rank}; set a positive rank (e.g. 16) or 0 to train every parameter")
        require(lora.rank == 0 or lora.alpha > 0,
                f"{key}.alpha={lora.alpha}; it must be positive (the adapters' scale is alpha / rank)")
        require(0 <= lora.dropout < 1, f"{key}.dropout={lora.dropout}; it must be in [0, 1)")
        require(lora.rank == 0 or len(lora.target_modules) > 0,
                f"{key}.target_modules is empty; name the linear layers to adapt, e.g. [q_proj, v_proj]")


# <section>.<key> -> its least value, and what to give instead (null, or a key the config lacks, always passes).
MINIMA = {
    "trainer.n_epochs": (1, "it must be at least 1 (or set trainer.total_steps)"),
    "trainer.total_steps": (1, "give at least 1 step, or null for trainer.n_epochs' worth"),
    "trainer.save_freq": (0, "give a number of steps (null or 0: never)"),
    "trainer.test_freq": (0, "give a number of steps (null or 0: never)"),
    "trainer.keep_last_n": (1, "keep at least 1 checkpoint (the latest), or null to keep all"),
    "data.max_prompts": (1, "it must be at least 1 (or null: all rows)"),
    "actor.freeze_steps": (0, "give the number of steps the actor waits (0: none)"),
    "rollout.max_turns": (1, "a trajectory takes at least 1 action"),
    "rollout.max_consecutive_timeouts": (1, "give the timeouts in a row that stop the run (1 or more), or null never "
                                            "to stop"),
    "rollout.agent_max_calls": (1, "give 1 or more, or null for no limit"),
    "rollout.agent_max_tokens": (1, "give 1 or more, or null for no limit"),
    "rollout.gpu_memory_margin_gb": (0, "give the GiB of each GPU that colocated SGLang servers leave free (0 or "
                                        "more)"),
    "rollout.max_sampling_rounds": (1, "it must be at least 1"),
    "rollout.test_prompts_per_rollout": (1, "test on at least 1 prompt, or leave it null to test on every prompt"),
    "rollout.over_sampling": (0, "give the groups started beyond the batch (0: none)"),
    "rollout.max_staleness": (0, "give the most updates a trained token may lag (0: none)"),
}


def check_run_sections(cfg) -> None:
    """Fail on data values and the counts of `MINIMA` outside their range, naming the key (only the keys that
    `cfg` has are checked, so every trainer's config and the evaluator's pass the same checks)."""
    data = cfg.get("data") or {}
    for name in ("train", "test"):
        split = data.get(name) or {}
        for key, what in (("batch_size", "examples per optimizer step"), ("max_length", "tokens")):
            require(split.get(key, 1) >= 1, f"data.{name}.{key}={split.get(key)}; it must be at least 1 ({what})")
    ratio = data.get("test_ratio", 0.0)
    require(0 <= ratio < 1, f"data.test_ratio={ratio}; it is the fraction of the training rows held out as the test "
                            f"split: set it in [0, 1) (0 holds out nothing), or give the test rows as data.test.path")
    for key, (least, what) in MINIMA.items():
        section, name = key.split(".")
        value = (cfg.get(section) or {}).get(name)
        require(value is None or value >= least, f"{key}={value}; {what}")


# Beyond one generation request (`rollout.request_timeout`), what a rank may wait for the others in the
# gather of a rollout: their environment steps and the requests they make after it.
REQUEST_TIMEOUT_MARGIN = 600.0


@dataclass
class TrainerConfig:
    project: str = opt("RL2", "project name (wandb project)")
    experiment_name: str = opt("run", "run name; default save_dir is ckpts/<experiment_name>")
    n_epochs: int = opt(1, "passes over the training set")
    total_steps: int | None = opt(None, "stop after this many optimizer steps (default: n_epochs worth)")
    save_dir: str = opt("ckpts/${trainer.experiment_name}", "folder for checkpoints, metrics.jsonl and final models")
    save_freq: int | None = opt(None, "write a resumable checkpoint every this many steps (null or 0: never)")
    keep_last_n: int | None = opt(None, "keep only the newest this many step checkpoints in save_dir, never the one "
                                  "latest.txt names (null: keep all)")
    load_ckpt_from: str | None = opt(None, "resume from 'latest' (in save_dir) or a step<N> folder")
    use_wandb: bool = opt(False, "also log to wandb (honours WANDB_MODE=offline|disabled)")
    use_tensorboard: bool = opt(False, "also write every metric as TensorBoard event files in <save_dir>/tensorboard "
                                "(pip install tensorboard)")
    plot_learning_curve: bool = opt(True, "draw <save_dir>/learning_curve.png from metrics.jsonl at every checkpoint "
                                    "and at the end (needs matplotlib)")
    seed: int = opt(42, "seed for data order, initialisation and sampling")
    test_freq: int | None = opt(None, "evaluate on the test split every this many steps (and at the end; null or 0: "
                                "never)")
    eval_only: bool = opt(False, "only evaluate (the initial model, or the checkpoint of load_ckpt_from) and stop")
    device: str = opt("auto", "auto | cpu | cuda", choices=("auto", "cpu", "cuda"))
    collective_timeout: float | None = opt(None, "seconds a rank waits in a collective (a rollout gather, an "
                                           "all-reduce) for the others before the run fails; default 1800, and with a "
                                           "rollout at least rollout.request_timeout + 600, as ranks wait in the "
                                           "gather while another rank's requests run")


@dataclass
class SFTConfig:
    data: DataConfig = opt(DataConfig, "data")
    actor: ModelConfig = opt(ModelConfig, "the model being trained")
    trainer: TrainerConfig = opt(TrainerConfig, "run control")


@dataclass
class PreferenceModelConfig(ModelConfig):
    beta: float = opt(0.1, "DPO: strength of the implicit KL to the reference; ORPO: weight of the odds-ratio term")
    loss_type: str = opt("sigmoid", "DPO loss: sigmoid (DPO) | ipo", choices=("sigmoid", "ipo"))
    label_smoothing: float = opt(0.0, "conservative DPO: assumed probability that a preference label is flipped")


@dataclass
class DPOConfig:
    data: DataConfig = opt(DataConfig, "data: prompt/chosen/rejected rows")
    actor: PreferenceModelConfig = opt(PreferenceModelConfig, "the policy; its initial weights: the frozen reference")
    trainer: TrainerConfig = opt(TrainerConfig, "run control")


@dataclass
class ORPOConfig:
    data: DataConfig = opt(DataConfig, "data: prompt/chosen/rejected rows")
    actor: PreferenceModelConfig = opt(PreferenceModelConfig, "the policy (no reference model)")
    trainer: TrainerConfig = opt(TrainerConfig, "run control")


@dataclass
class RMConfig:
    data: DataConfig = opt(DataConfig, "data: prompt/chosen/rejected rows")
    critic: ModelConfig = opt(ModelConfig, "the reward model: a causal LM with a scalar head on every token")
    trainer: TrainerConfig = opt(TrainerConfig, "run control")


@dataclass
class DistillModelConfig(ModelConfig):
    teacher_name: str = opt("smollm2-135m-instruct", "the frozen teacher (HF folder or name; same tokenizer as the "
                            "student)")
    kl: str = opt("forward", "forward KL(teacher || student) (mode covering) | reverse KL(student || teacher) (mode "
                  "seeking)", choices=("forward", "reverse"))
    temperature: float = opt(1.0, "softens both distributions before the KL")


@dataclass
class DistillConfig:
    data: DataConfig = opt(DataConfig, "data: SFT rows; the teacher scores the same tokens")
    actor: DistillModelConfig = opt(DistillModelConfig, "the student")
    trainer: TrainerConfig = opt(TrainerConfig, "run control")
