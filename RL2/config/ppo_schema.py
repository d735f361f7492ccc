"""Typed config of the RL trainer (`RL2.trainer.ppo`): PPO with a critic, GRPO and relatives.

Key names follow upstream RL2's ppo.yaml. Values outside their choices fail at start
(`check_ppo_choices`), naming the key.
"""

from dataclasses import dataclass
from typing import Any

from RL2.config.cli import ConfigError
from RL2.config.schema import DataConfig, ModelConfig, TrainerConfig, opt


@dataclass
class SamplingConfig:
    temperature: float = opt(1.0, "sampling temperature (0 is greedy)")
    top_p: float = opt(1.0, "nucleus sampling: keep the most likely tokens covering this probability")
    top_k: int = opt(-1, "keep the k most likely tokens (-1: all)")
    max_new_tokens: int = opt(256, "the most tokens of one action")


@dataclass
class TestSamplingConfig(SamplingConfig):
    temperature: float = opt(0.0, "sampling temperature at test time (0 is greedy)")


@dataclass
class RolloutConfig:
    env_path: str = opt("envs/arithmetic.py", "environment script defining `async def step(state, action, extra_info)`")
    responses_per_prompt: int = opt(4, "trajectories per prompt (the GRPO group size)")
    test_responses_per_prompt: int = opt(1, "trajectories per test prompt (pass@k uses all of them)")
    max_turns: int = opt(1, "the most actions of one trajectory")
    max_total_tokens: int | None = opt(None, "the most tokens of one sequence (prompt, actions, observations)")
    env_timeout: float | None = opt(None, "seconds one environment step may take before the trajectory fails")
    dynamic_filtering: bool = opt(False, "drop groups whose rewards are all equal (DAPO's dynamic sampling)")
    max_running_requests: int = opt(64, "requests the embedded engine decodes together on one rank")
    train_sampling_params: SamplingConfig = opt(SamplingConfig, "sampling of training rollouts")
    test_sampling_params: TestSamplingConfig = opt(TestSamplingConfig, "sampling of test rollouts")
    reward_model: str | None = opt(None, "a reward model exported by RL2.trainer.rm (final/critic); its score is added to the environment reward")
    save_samples: bool = opt(False, "append every trajectory to <save_dir>/samples.jsonl (rank 0)")


@dataclass
class KLConfig:
    coef: float = opt(0.0, "weight of the KL to the reference (the initial actor); 0 loads no reference")
    engine: str = opt("auto", "embedded (in-process, one per rank) | sglang (SGLang servers) | auto: sglang when rollout.server_url is set or on CUDA with sglang installed, else embedded")
    server_args: dict[str, Any] = opt({}, "flags of `python -m sglang.launch_server` for launched servers, e.g. {tp_size: 2, mem_fraction_static: 0.6}")
    server_url: Any = opt(None, "external SGLang server(s) already running: a URL, comma-separated URLs or a list; nothing is launched")
    server_python: str | None = opt(None, "the Python that runs launched servers (e.g. a separate SGLang venv's bin/python); default: the trainer's")
    server_env: dict[str, str] = opt({}, "extra environment variables of launched servers")
    server_timeout: float = opt(900.0, "seconds a launched server may take to become ready")
    server_log_dir: str | None = opt(None, "folder of the launched servers' logs (default: a temporary folder)")
    weight_sync: str = opt("auto", "how SGLang servers get new weights: tensor (CUDA IPC) | disk (HF folder) | none | auto: tensor for launched CUDA servers with sglang in the trainer's env, else disk")
    weight_bucket_mb: float = opt(512.0, "MB of full tensors gathered and sent (or written) at a time during a weight sync")
    weights_dir: str | None = opt(None, "where disk weight syncs write (must be readable by the servers); default: a temporary folder")
    type: str = opt("loss", "where the KL goes: loss (added to the actor loss) | reward (subtracted from the reward)")
    estimator: str = opt("k3", "per-token KL estimator: k1 | k2 | k3")


@dataclass
class TeacherConfig:
    model_name: str | None = opt(None, "on-policy distillation: a frozen teacher whose per-token reverse KL to the actor's samples is a penalty on the reward")
    coef: float = opt(1.0, "weight of the teacher's per-token reverse KL in the reward")


@dataclass
class EntropyConfig:
    coef: float = opt(0.0, "weight of the entropy bonus in the actor loss")


@dataclass
class ActorConfig(ModelConfig):
    clip: float = opt(0.2, "PPO clip range of the ratio (both sides unless clip_low/clip_high are set)")
    clip_low: float | None = opt(None, "lower clip range (default: clip)")
    clip_high: float | None = opt(None, "upper clip range (default: clip); DAPO's clip-higher uses ~0.28")
    dual_clip: float | None = opt(None, "dual-clip constant c > 1 bounding the loss of negative-advantage tokens")
    tis_coef: float | None = opt(None, "cap of the truncated importance weight old/engine probability (None: off)")
    update_per_rollout: int = opt(1, "passes (PPO epochs) over each rollout")
    mini_batch_size: int | None = opt(None, "prompts per optimizer step; None: the whole rollout in one step")
    kl: KLConfig = opt(KLConfig, "KL to the reference")
    entropy: EntropyConfig = opt(EntropyConfig, "entropy bonus")
    teacher: TeacherConfig = opt(TeacherConfig, "on-policy distillation")


@dataclass
class CriticConfig(ModelConfig):
    value_clip: float | None = opt(0.5, "PPO value clipping around the rollout-time values (None: off)")
    update_per_rollout: int = opt(1, "passes over each rollout")
    mini_batch_size: int | None = opt(None, "prompts per optimizer step; None: the whole rollout in one step")


@dataclass
class AdvConfig:
    estimator: str = opt("reinforce", "advantage estimator: gae (PPO, trains a critic) | reinforce (GRPO) | rloo | reinforce_plus_plus | raw")
    gamma: float = opt(1.0, "discount per action token (gae, reinforce_plus_plus)")
    lamda: float = opt(1.0, "GAE lambda")
    norm_var: bool = opt(True, "reinforce: divide by the group std (GRPO); false is Dr. GRPO")
    global_norm: bool = opt(False, "reinforce: divide the advantages by their std over the batch")


@dataclass
class PPOConfig:
    data: DataConfig = opt(DataConfig, "data: prompt rows with extra_info for the environment")
    rollout: RolloutConfig = opt(RolloutConfig, "how trajectories are sampled")
    actor: ActorConfig = opt(ActorConfig, "the policy")
    critic: CriticConfig = opt(CriticConfig, "the value model (trained only when adv.estimator=gae)")
    adv: AdvConfig = opt(AdvConfig, "advantage estimation")
    trainer: TrainerConfig = opt(TrainerConfig, "run control")


# Not in RL2.config.cli.CHOICES: those are matched by key suffix, and `type`/`estimator` are too generic.
PPO_CHOICES = {
    "actor.kl.type": ("loss", "reward"),
    "actor.kl.estimator": ("k1", "k2", "k3"),
    "adv.estimator": ("gae", "reinforce", "rloo", "reinforce_plus_plus", "raw"),
    "rollout.engine": ("auto", "embedded", "sglang"),
    "rollout.weight_sync": ("auto", "tensor", "disk", "none"),
}


def check_ppo_choices(cfg) -> None:
    """Fail on a value outside PPO_CHOICES or an inconsistent combination, naming the key."""
    for key, choices in PPO_CHOICES.items():
        section, *rest = key.split(".")
        value = cfg[section]
        for part in rest:
            value = value[part]
        if value not in choices:
            raise ConfigError(f"config key '{key}' is {value!r}; choose one of {', '.join(choices)}")
    if cfg.rollout.responses_per_prompt < 1 or cfg.actor.update_per_rollout < 1:
        raise ConfigError("rollout.responses_per_prompt and actor.update_per_rollout must be at least 1")
    if cfg.adv.estimator in ("reinforce", "rloo") and cfg.rollout.responses_per_prompt < 2:
        raise ConfigError(
            f"adv.estimator={cfg.adv.estimator} compares responses to the same prompt; "
            f"set rollout.responses_per_prompt >= 2"
        )
