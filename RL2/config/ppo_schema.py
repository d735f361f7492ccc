"""Typed config of the RL trainer (`RL2.trainer.ppo`), key names as upstream RL2's ppo.yaml, and the checks of
combinations that cannot do what they say (`check_ppo_config`)."""

import functools
from dataclasses import asdict, dataclass
from typing import Any

from RL2.config.errors import ConfigError, require
from RL2.config.schema import DataConfig, ModelConfig, TrainerConfig, opt

# A temperature below this samples greedily, as in SGLang (`_SAMPLING_EPS` of its sampling_params.py).
GREEDY_TEMPERATURE = 1e-6
# rollout.gpu_memory_margin_gb's default; tests/gpu/test_cuda_memory_margin.py checks a tiny model keeps within it.
COLOCATED_MARGIN_GB = 1.0


@dataclass
class SamplingConfig:
    temperature: float = opt(1.0, "sampling temperature (0 is greedy; training needs a positive one: the trained "
                             "policy is softmax(logits / temperature))")
    top_p: float = opt(1.0, "nucleus sampling: keep the most likely tokens covering this probability")
    top_k: int = opt(-1, "keep the k most likely tokens (-1: all)")
    max_new_tokens: int = opt(256, "the most tokens of one action")
    ignore_eos: bool = opt(False, "keep sampling past end-of-sequence tokens (fixed-length benchmarks)")
    stop: Any = opt(None, "stop strings: an action ends with the first one it writes, e.g. ['</search>', '</answer>'] "
                    "(the action passed to step ends with it; every sampled token is trained)")
    stop_token_ids: list[int] = opt([], "token ids that end an action besides the model's end-of-sequence tokens")
    no_stop_trim: bool = opt(True, "keep the matched stop string at the end of the action (the original RL2's "
                             "spelling; RL2 always does, as the action's tokens are all trained)")


@dataclass
class TestSamplingConfig(SamplingConfig):
    temperature: float = opt(0.0, "sampling temperature at test time (0 is greedy)")


@dataclass
class JudgeConfig:
    url: str | None = opt(None, "an OpenAI-compatible server (e.g. http://host:8000/v1) whose model judges responses "
                          "for RL2.rewards.judge_reward; or model_path")
    model: str = opt("default", "the model name asked of judge.url")
    api_key: str | None = opt(None, "judge.url's key (default: $OPENAI_API_KEY)")
    model_path: str | None = opt(None, "a frozen model (HF folder or bundled name) each rank serves on an embedded "
                                 "engine of its own as the judge, sharing nothing with the policy; or url")
    rubric: str = opt("quality", "the judge's prompt: quality | correctness (built-in, with worked examples) | a .json "
                      "file of chat messages | a text file or text: the user message; {question}, {response} and "
                      "{reference} in them are filled in")
    score_range: list[float] = opt([0, 10], "the scores the rubric asks for, as <score>N</score>, [low, high]: N "
                                   "becomes (N - low) / (high - low)")
    question_key: str = opt("question", "extra_info key of the question the rubric shows as {question}")
    reference_key: str = opt("answer", "extra_info key of the reference answer the rubric shows as {reference}")
    max_concurrency: int = opt(8, "judge calls of one rank in flight at once; the others wait")
    timeout: float | None = opt(60.0, "seconds one judge call may take (null: no limit)")
    max_retries: int = opt(2, "a failed judge call (an error, no answer in time, no score) is asked again this many "
                           "times, then the trajectory ends as a fault (rollout/faults/judge)")
    max_new_tokens: int = opt(64, "the most tokens of the judge's answer")
    temperature: float = opt(0.0, "the judge's sampling temperature (0: greedy; retries then give the same answer)")


@dataclass
class RolloutConfig:
    env_path: str | None = opt(None, "environment script defining `async def step(state, action, extra_info)`, e.g. "
                               "envs/arithmetic.py (one of env_path, reward_fn and agent_path is needed)")
    reward_fn: str | None = opt(None, "train single-turn on a plain `reward(response, extra_info) -> float | dict` "
                                "(sync or async) instead of rollout.env_path: 'path/to/file.py:name' or "
                                "'package.module:name', e.g. RL2.rewards:math_reward")
    responses_per_prompt: int = opt(4, "trajectories per prompt (the GRPO group size)")
    test_responses_per_prompt: int = opt(1, "trajectories per test prompt (pass@k uses all of them)")
    test_prompts_per_rollout: int | None = opt(None, "test prompts of one evaluation: the next this many of the test "
                                               "split in a shuffled order (seeded by trainer.seed) that successive "
                                               "evaluations walk through; None: every test prompt")
    max_turns: int = opt(1, "the most actions of one trajectory")
    max_total_tokens: int | None = opt(None, "the most tokens of one sequence (prompt, actions, observations); unset: "
                                       "the model's context (server_args.context_length, else max_position_embeddings)")
    env_timeout: float | None = opt(300.0, "seconds one environment step (or reset) may take, from its start, before "
                                    "its trajectory fails (null: no limit); it holds for blocking code too: a step "
                                    "past it keeps its thread while the others go on in a new one")
    agent_path: str | None = opt(None, "an agent script defining `async def run(client, extra_info) -> float | dict`, "
                                 "client an openai.AsyncOpenAI served by the rollout engine, instead of "
                                 "rollout.env_path: every call's tokens are recorded, one run is one trajectory")
    agent_timeout: float | None = opt(600.0, "seconds one agent run may take, model calls included, before it fails")
    agent_max_calls: int | None = opt(256, "model calls one agent run may make; a call past them is refused (HTTP "
                                      "400, code run_budget_exceeded) and the run ends as a fault (null: no limit)")
    agent_max_tokens: int | None = opt(None, "tokens one agent run may sample over all its calls; each call's "
                                       "max_new_tokens is cut to what is left, and a call with none left is refused "
                                       "and the run ends as a fault (null: no limit)")
    max_consecutive_timeouts: int | None = opt(32, "stop the run when this many environment steps and resets (or agent "
                                               "runs) of a rank time out in a row: a script hanging on every call (a "
                                               "dead server, an endless loop) faults every trajectory (null: never)")
    code_sandbox_unisolated: bool = opt(False, "where the system refuses namespaces (Docker's default seccomp, most "
                                        "Kubernetes pods), let RL2.rewards.code_reward run model-written code with an "
                                        "in-process guard only: that gives up isolation from the host's files, "
                                        "network, sockets and processes (false: such runs stop with an error)")
    judge: JudgeConfig = opt(JudgeConfig, "an LLM judge, the reward of RL2.rewards.judge_reward (docs/rewards.md)")
    tool_parser: str = opt("auto", "the policy's tool-call format, for environments that declare TOOLS: auto (from the "
                           "chat template; Hermes <tool_call> JSON, RL2's default, for templates that know no tools) | "
                           "hermes (alias qwen) | llama3 | mistral | 'file.py:Class' / 'module:Class' (a "
                           "RL2.rollout.tools.tool_calls.ToolCallParser)")
    tool_timeout: float | None = opt(60.0, "seconds a tool call may take; a slower one gives the model an error result")
    tool_error: str = opt("observe", "a tool call that cannot be parsed, names no tool or fails: observe (the model "
                          "gets the error as its result) | end (the trajectory faults)", choices=("observe", "end"))
    tool_call_stop: bool = opt(True, "end an action at the format's end of a call (</tool_call>), so that the model's "
                               "own guess of the result is never sampled")
    train_on_faults: bool = opt(False, "train on a trajectory a fault ended (a failing environment, reward, tool or "
                                "agent) with reward 0; false: leave it out of the loss and of its group's baseline")
    dynamic_filtering: bool = opt(False, "drop groups whose rewards are all equal and sample more prompts until the "
                                  "batch is full (DAPO's dynamic sampling)")
    max_sampling_rounds: int = opt(4, "dynamic filtering: the most rollouts of data.train.batch_size prompts one step "
                                   "may use to fill its batch")
    partial_rollout: bool = opt(False, "stop a rollout once the batch has enough finished groups; the others carry on "
                                "in the next step, under newer weights (see max_staleness, actor.correction)")
    over_sampling: int = opt(0, "partial rollout: groups kept in flight beyond data.train.batch_size (slime's "
                             "over_sampling_batch_size less the batch): a step trains on the first batch_size groups "
                             "to finish, and the slowest are cut and carried into the next; 0: only what dynamic "
                             "filtering leaves over is carried")
    max_staleness: int | None = opt(None, "partial rollout: a carried group whose oldest token was sampled more than "
                                    "this many updates before the weights trained is dropped, its prompt slot refilled "
                                    "(AReaL's max_head_offpolicyness; 0 drops every carried group; None: no bound)")
    overlong_buffer_len: int | None = opt(None, "DAPO's soft overlong punishment: a ramp of this many tokens before "
                                          "max_new_tokens (None: off)")
    overlong_penalty_factor: float = opt(1.0, "the overlong penalty at max_new_tokens, in units of reward")
    length_penalty_coef: float = opt(0.0, "length shaping: reward -= this x (response length / max_new_tokens)")
    max_running_requests: int = opt(64, "requests the embedded engine decodes together on one rank")
    train_sampling_params: SamplingConfig = opt(SamplingConfig, "sampling of training rollouts")
    test_sampling_params: TestSamplingConfig = opt(TestSamplingConfig, "sampling of test rollouts")
    reward_model: str | None = opt(None, "a reward model exported by RL2.trainer.rm (final/critic); its score is added "
                                   "to the environment reward")
    save_samples: bool = opt(False, "append every trajectory to <save_dir>/samples.jsonl (rank 0)")
    save_sample_tokens: int = opt(0, "with save_samples: also write up to this many tokens of each "
                                  "trajectory's responses, with their loss mask, log-probabilities (the engine's and "
                                  "the trainer's, computed then even where one update covers the rollout), advantage "
                                  "and weight version, which python -m RL2.viewer colours them by (0: none)")
    engine: str = opt("auto", "embedded (in-process, one per rank) | sglang (SGLang servers) | auto: sglang when "
                      "rollout.server_url is set or on CUDA with sglang installed, else embedded",
                      choices=("auto", "embedded", "sglang"))
    server_args: dict[str, Any] = opt({}, "flags of `python -m sglang.launch_server` for launched servers, e.g. "
                                      "{tp_size: 2, mem_fraction_static: 0.6}")
    server_url: Any = opt(None, "external SGLang server(s) already running: a URL, comma-separated URLs or a list; "
                          "nothing is launched")
    gpu_memory_margin_gb: float = opt(COLOCATED_MARGIN_GB, "GiB of each GPU that SGLang servers launched beside the "
                                      "trainer leave free when they size their KV cache, besides SGLang's own "
                                      "headroom: what the trainer's memory left on the GPU (its state offloaded) grows "
                                      "by after the servers start; ignored when server_args sets mem_fraction_static")
    server_python: str | None = opt(None, "the Python that runs launched servers (e.g. a separate SGLang venv's "
                                    "bin/python); default: the trainer's")
    server_env: dict[str, str] = opt({}, "extra environment variables of launched servers")
    server_timeout: float = opt(900.0, "seconds a launched server may take to become ready")
    request_timeout: float = opt(3600.0, "seconds one SGLang generation request may take, queueing and the full answer "
                                 "included, before the rollout fails (long reasoning on busy servers needs many)")
    api_key: str | None = opt(None, "key of the SGLang servers: sent as `Authorization: Bearer` to rollout.server_url, "
                              "given to launched servers in a private --config file, never on their command line "
                              "(unset: launched servers get a random one)")
    server_log_dir: str | None = opt(None, "folder of the launched servers' logs (default: a temporary folder)")
    weight_sync: str = opt("auto", "how SGLang servers get new weights: tensor (CUDA IPC buckets) | disk (HF folder) | "
                           "none | auto: tensor for launched CUDA servers of a version whose bucket format RL2 writes, "
                           "else disk", choices=("auto", "tensor", "disk", "none"))
    weight_bucket_mb: float = opt(512.0, "MB of full tensors gathered and sent (or written) at once in a weight sync")
    weights_dir: str | None = opt(None, "where disk weight syncs write (must be readable by the servers); default: a "
                                  "temporary folder")
    check_weight_sync: bool = opt(True, "after each weight push, have every SGLang server confirm it wrote all its "
                                  "parameters (its /weights_checker randomizes them before the push and compares "
                                  "checksums after); a parameter left unwritten stops the run")


@dataclass
class KLConfig:
    coef: float = opt(0.0, "weight of the KL to the reference (the initial actor); 0 loads no reference")
    type: str = opt("loss", "where the KL goes: loss (added to the actor loss) | reward (subtracted from the reward)",
                    choices=("loss", "reward"))
    estimator: str = opt("k3", "per-token KL estimator: k1 | k2 | k3", choices=("k1", "k2", "k3"))
    reset_every: int | None = opt(None, "ProRL: reset the reference to the actor every this many steps (None: never)")
    reset_target: float | None = opt(None, "ProRL: reset the reference when the KL to it exceeds this (None: never)")
    reset_entropy_floor: float | None = opt(None, "ProRL: reset the reference after a step whose mean policy entropy "
                                            "(actor/entropy) fell below this (None: never)")
    reset_alpha: float = opt(1.0, "a reset sets reference = alpha * actor + (1 - alpha) * reference (1: copy)")


@dataclass
class TeacherConfig:
    model_name: str | None = opt(None, "on-policy distillation: a frozen teacher whose per-token reverse KL to the "
                                 "actor's samples is a penalty on the reward")
    coef: float = opt(1.0, "weight of the teacher's per-token reverse KL in the reward")


@dataclass
class EntropyConfig:
    coef: float = opt(0.0, "weight of the entropy bonus in the actor loss")


@dataclass
class GSPOConfig:
    clip_low: float = opt(3e-4, "GSPO: the sequence ratio is clipped at 1 - clip_low (the paper's 3e-4)")
    clip_high: float = opt(4e-4, "GSPO: the sequence ratio is clipped at 1 + clip_high (the paper's 4e-4)")


@dataclass
class CISPOConfig:
    clip_low: float | None = opt(None, "CISPO: the importance weight is at least 1 - clip_low (None: no lower bound, "
                                 "as the paper)")
    clip_high: float = opt(3.0, "CISPO: the importance weight is at most 1 + clip_high (the paper tunes only this)")


# actor.correction.type (the choices besides none) -> its bounds (low, high) of rho where actor.correction.low /
# high are unset; a low of None is 1 / high. RL2.algs.policy_loss.CORRECTIONS holds the correction of each name.
CORRECTION_BOUNDS = {"tis": (None, 2.0), "icepop": (0.5, 5.0), "seq_mask": (None, 2.0), "geo_mask": (None, 1.001)}


def correction_bounds(name: str, low: float | None = None, high: float | None = None) -> tuple[float, float]:
    """The bounds (low, high) of rho of the correction `name`: those given, else `CORRECTION_BOUNDS`."""
    default_low, default_high = CORRECTION_BOUNDS[name]
    high = default_high if high is None else high
    low = (1.0 / high if default_low is None else default_low) if low is None else low
    return low, high


@dataclass
class CorrectionConfig:
    type: str = opt("none", "corrects the policy loss for tokens the engine sampled from a distribution other than the "
                    "trainer's (other kernels and precision; older weights in a partial rollout), from each token's "
                    "rho = pi_old / pi_engine: none | tis (weight min(rho, high); actor.tis_coef=C is type=tis, "
                    "high=C) | icepop (mask tokens with rho outside [low, high], weight rho inside) | seq_mask (mask "
                    "trajectories whose product of rho is outside [low, high]) | geo_mask (the same on rho's geometric "
                    "mean)", choices=("none", *CORRECTION_BOUNDS))
    low: float | None = opt(None, "lower bound of rho (icepop, seq_mask, geo_mask); default: 0.5 (icepop) or 1 / high")
    high: float | None = opt(None, "upper bound of rho; default: 2 (tis, seq_mask), 5 (icepop), 1.001 (geo_mask)")


# actor.policy_loss (the choices) -> the actor keys only it reads, with their defaults (PPO's are top-level for
# RL2's original names). RL2.workers.actor.POLICY_LOSSES holds the loss of each name.
_GSPO_KEYS = {f"gspo.{k}": v for k, v in asdict(GSPOConfig()).items()}
POLICY_LOSS_KEYS = {
    "ppo": {"clip": 0.2, "clip_low": None, "clip_high": None, "dual_clip": None},
    "gspo": _GSPO_KEYS,
    "gspo_token": _GSPO_KEYS,
    "cispo": {f"cispo.{k}": v for k, v in asdict(CISPOConfig()).items()},
}


@dataclass
class ActorConfig(ModelConfig):
    policy_loss: str = opt("ppo", "ppo (clipped surrogate on token ratios) | gspo (one clipped ratio per trajectory) | "
                           "gspo_token (GSPO's ratio with per-token advantages) | cispo (clipped, detached weight "
                           "times the log-prob)", choices=tuple(POLICY_LOSS_KEYS))
    clip: float = opt(0.2, "policy_loss=ppo: clip range of the ratio (both sides unless clip_low/clip_high are set)")
    clip_low: float | None = opt(None, "policy_loss=ppo: lower clip range (default: clip)")
    clip_high: float | None = opt(None, "policy_loss=ppo: upper clip range (default: clip); DAPO's clip-higher: ~0.28")
    dual_clip: float | None = opt(None, "policy_loss=ppo: dual-clip constant c > 1 bounding the loss of "
                                  "negative-advantage tokens")
    gspo: GSPOConfig = opt(GSPOConfig, "GSPO's clip ranges (policy_loss=gspo or gspo_token)")
    cispo: CISPOConfig = opt(CISPOConfig, "CISPO's weight bounds (policy_loss=cispo)")
    tis_coef: float | None = opt(None, "cap of the truncated importance weight old/engine probability (None: off); the "
                                 "short form of actor.correction.type=tis actor.correction.high=C")
    correction: CorrectionConfig = opt(CorrectionConfig, "engine-vs-trainer correction of the policy loss (truncation "
                                       "or masking)")
    update_per_rollout: int = opt(1, "passes (PPO epochs) over each rollout")
    mini_batch_size: int | None = opt(None, "prompts per optimizer step; None: the whole rollout in one step")
    freeze_steps: int = opt(0, "PPO's critic warm-up: the actor waits this many steps while the critic learns the "
                            "initial policy's values (adv.estimator=gae); its learning-rate schedule starts after them")
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
    """Advantage estimation. The default is Dr. GRPO's (arXiv 2503.20783) advantage with DAPO's token-level loss;
    DeepSeek's GRPO (arXiv 2402.03300) is `adv.norm_var=true actor.avg_level=sequence` (docs/rl.md)."""

    estimator: str = opt("grpo", "gae (PPO with a critic) | grpo (group mean baseline, no std division unless "
                         "adv.norm_var=true; alias reinforce) | rloo | reinforce_plus_plus | raw | mc (multi-turn "
                         "returns)", choices=("gae", "grpo", "rloo", "reinforce_plus_plus", "raw", "mc"),
                         aliases={"reinforce": "grpo"})
    gamma: float = opt(1.0, "discount per action token (gae, reinforce_plus_plus) or per turn (mc)")
    lamda: float = opt(1.0, "GAE lambda (gae only)")
    norm_var: bool = opt(False, "grpo only: divide by the group std (DeepSeek's GRPO); false (the default) is Dr. GRPO")
    baseline: str = opt("group", "grpo only: the mean a score is compared with: group (of its prompt's responses, "
                        "GRPO) | batch (of every response of the batch, REINFORCE with a batch baseline: the original "
                        "RL2's adv.global_norm=true, and its default for one response per prompt); adv.norm_var "
                        "divides by the same set's std", choices=("group", "batch"))
    global_norm: bool = opt(False, "whiten the advantages over every sampled token of the batch (mean 0, std 1), after "
                            "any estimator but reinforce_plus_plus, which always does")
    truncation: int | None = opt(None, "mc only: turns summed into each return (None: to the end of the trajectory)")


@dataclass
class PPOConfig:
    data: DataConfig = opt(DataConfig, "data: prompt rows with extra_info for the environment")
    rollout: RolloutConfig = opt(RolloutConfig, "how trajectories are sampled")
    actor: ActorConfig = opt(ActorConfig, "the policy")
    critic: CriticConfig = opt(CriticConfig, "the value model (trained only when adv.estimator=gae)")
    adv: AdvConfig = opt(AdvConfig, "advantage estimation")
    trainer: TrainerConfig = opt(TrainerConfig, "run control")


def check_ppo_config(cfg) -> None:
    """Fail on an inconsistent combination, naming the keys (the command line checks single values' choices)."""
    kl, rollout, train_sampling = cfg.actor.kl, cfg.rollout, cfg.rollout.train_sampling_params
    require(min(rollout.responses_per_prompt, cfg.actor.update_per_rollout, cfg.critic.update_per_rollout) >= 1,
            "rollout.responses_per_prompt, actor.update_per_rollout and critic.update_per_rollout must be at least 1")
    estimator, frozen = cfg.adv.estimator, cfg.actor.freeze_steps  # the actor waits while PPO's critic warms up
    require(frozen == 0 or estimator == "gae", f"actor.freeze_steps={frozen} lets PPO's critic learn before the actor "
            f"moves, but adv.estimator={estimator} trains no critic; set adv.estimator=gae or drop it")
    if resets_reference(kl) and kl.coef <= 0:
        raise ConfigError("actor.kl.reset_every / reset_target / reset_entropy_floor reset the reference, which "
                          "exists only with actor.kl.coef > 0; set it or drop the reset")
    require(kl.reset_entropy_floor is None or kl.reset_entropy_floor > 0, f"actor.kl.reset_entropy_floor is "
            f"{kl.reset_entropy_floor}; an entropy is never below 0, so set a positive floor (in nats per token) or "
            f"leave it null")
    require(0 < kl.reset_alpha <= 1, f"actor.kl.reset_alpha is {kl.reset_alpha}; it must be in (0, 1] (1 copies the "
                                     f"actor)")
    check_algorithm(cfg.adv, kl)
    check_policy_loss(cfg.actor)
    overlong = rollout.overlong_buffer_len
    require(overlong is None or 0 < overlong <= train_sampling.max_new_tokens, f"rollout.overlong_buffer_len="
            f"{overlong} must be in (0, rollout.train_sampling_params.max_new_tokens={train_sampling.max_new_tokens}]")
    check_rollout(rollout, ("train_sampling_params", "test_sampling_params"))
    require(not (rollout.agent_path and rollout.partial_rollout), f"rollout.partial_rollout=true with "
            f"rollout.agent_path={rollout.agent_path}: a partial rollout carries cut trajectories over a weight "
            f"update, and an agent script's run (its own Python coroutine) cannot be carried over one nor kept in a "
            f"checkpoint (docs/async.md, \"Agents\"); drop rollout.partial_rollout (with rollout.over_sampling and "
            f"rollout.max_staleness), or roll out an environment (rollout.env_path)")
    check_staleness(rollout, cfg.actor)
    require(train_sampling.temperature >= GREEDY_TEMPERATURE, f"rollout.train_sampling_params.temperature="
            f"{train_sampling.temperature} samples greedily, but the trained policy is softmax(logits / temperature), "
            f"which has no log-probabilities at 0 (and every response to a prompt would be the same). Give a positive "
            f"temperature (1: the model's own distribution); rollout.test_sampling_params may stay greedy")
    by_group = estimator == "rloo" or (estimator == "grpo" and cfg.adv.baseline == "group")
    hint = " or adv.baseline=batch" if estimator == "grpo" else ""
    require(rollout.responses_per_prompt >= 2 or not by_group, f"adv.estimator={estimator} compares responses to "
            f"the same prompt; set rollout.responses_per_prompt >= 2{hint}")


def resets_reference(kl) -> bool:
    """Whether `actor.kl` asks for ProRL's resets of the reference."""
    return bool(kl.reset_every or kl.reset_target is not None or kl.reset_entropy_floor is not None)


def check_staleness(rollout, actor) -> None:
    """A partial rollout trains on tokens of older weights: the over-sampling that cuts the slowest groups, the
    bound on their staleness and the correction of the loss must fit together."""
    extra, partial, eta = rollout.over_sampling, rollout.partial_rollout, rollout.max_staleness
    require(extra == 0 or partial, f"rollout.over_sampling={extra} starts groups beyond the batch for a partial "
                                   f"rollout to cut; set rollout.partial_rollout=true or drop it")
    if eta is not None:
        require(partial, f"rollout.max_staleness={eta} bounds how old the groups a partial rollout carries may be; "
                         f"without rollout.partial_rollout=true every token is sampled by the weights trained")
        require(rollout.weight_sync != "none", f"rollout.max_staleness={eta} with rollout.weight_sync=none: the "
                f"engine keeps its first weights, so every token falls further behind each step; drop one of them")
    check_correction(actor)
    corrected = actor.tis_coef is not None or actor.correction.type != "none"
    require(not partial or eta == 0 or corrected, f"rollout.partial_rollout trains on tokens sampled by weights up "
            f"to {'any number of' if eta is None else eta} updates old, with no correction for it: set "
            f"actor.correction.type (tis, icepop, seq_mask or geo_mask; actor.tis_coef=2 is tis), or "
            f"rollout.max_staleness=0 to train on tokens of the current weights only")


def check_correction(actor) -> None:
    """The engine correction's bounds: set for the correction chosen, and low < high."""
    correction = actor.correction
    kind, low, high = correction.type, correction.low, correction.high
    require(actor.tis_coef is None or kind == "none", f"actor.tis_coef={actor.tis_coef} is the short form of "
            f"actor.correction.type=tis actor.correction.high={actor.tis_coef}; keep one of actor.tis_coef and "
            f"actor.correction.type")
    require(kind not in ("none", "tis") or low is None, f"actor.correction.low={low} means nothing for "
            f"actor.correction.type={kind}; it bounds icepop, seq_mask and geo_mask")
    require(kind != "none" or high is None,
            f"actor.correction.high={high} bounds a correction; set actor.correction.type")
    require((high is None or high > 0) and (low is None or low >= 0), f"actor.correction.low={low} and high={high} "
            f"bound a ratio of probabilities: high must be positive and low at least 0")
    if kind not in ("none", "tis"):
        low, high = correction_bounds(kind, low, high)
        require(low < high, f"actor.correction bounds [{low}, {high}] keep no ratio; set actor.correction.low below "
                            f"actor.correction.high")


def check_rollout(rollout, sampling_keys: tuple[str, ...]) -> None:
    """Fail at start, naming the key, on what to roll out and the judge, and on sampling settings (`sampling_keys`: the
    trainer's train and test sections, the evaluator's one) that the engines refuse, that sample nothing or cannot be
    honoured (`MINIMA` bounds the rollout's counts)."""
    require(not (rollout.get("agent_path") and rollout.get("reward_fn")),
            "rollout.agent_path and rollout.reward_fn both say what to roll out; keep one of them")
    judge = rollout.judge
    require(not (judge.url and judge.model_path), "rollout.judge.url and rollout.judge.model_path both give the judge; "
                                                  "keep one of them")
    require(not str(rollout.get("reward_fn") or "").endswith(":judge_reward") or judge.url or judge.model_path,
            f"rollout.reward_fn={rollout.reward_fn} asks the run's judge: set rollout.judge.url (an OpenAI-compatible "
            f"server) or rollout.judge.model_path (a model each rank serves)")
    require(judge.max_concurrency >= 1 and judge.max_retries >= 0 and len(judge.score_range) == 2
            and judge.score_range[0] < judge.score_range[1], "rollout.judge needs max_concurrency >= 1, max_retries "
            ">= 0 and score_range [low, high] with low < high")
    for name in sampling_keys:
        params, key = rollout[name], f"rollout.{name}"
        require(params.max_new_tokens >= 1,
                f"{key}.max_new_tokens={params.max_new_tokens}; an action needs at least 1 new token")
        require(params.temperature >= 0,
                f"{key}.temperature={params.temperature}; give 0 (greedy) or a positive temperature")
        require(0 < params.top_p <= 1,
                f"{key}.top_p={params.top_p}; it is the probability mass sampled from: set it in (0, 1]")
        stop = params.stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        require(all(isinstance(s, str) and s for s in stops), f"{key}.stop={stop!r}; give a string or a list of "
                f"non-empty strings, e.g. {key}.stop=['</search>','</answer>']")
        require(params.no_stop_trim, f"{key}.no_stop_trim=false would cut the stop string out of the action text "
                f"while its tokens are trained (RL2 trains on exactly the tokens sampled); drop it: the action passed "
                f"to step always ends with the matched stop string")


def check_algorithm(adv, kl) -> None:
    """Fail on a combination that cannot do what it says, saying why."""
    estimator = adv.estimator
    require(not adv.norm_var or estimator == "grpo", f"adv.norm_var divides GRPO's group baseline by the group std; "
            f"it means nothing for adv.estimator={estimator}. Drop it, or use adv.estimator=grpo")
    require(adv.get("baseline", "group") == "group" or estimator == "grpo", f"adv.baseline={adv.get('baseline')} is "
            f"the baseline of adv.estimator=grpo; adv.estimator={estimator} has its own. Drop it, or use "
            f"adv.estimator=grpo")
    require(not adv.global_norm or estimator != "reinforce_plus_plus", "adv.estimator=reinforce_plus_plus already "
            "whitens its returns over the batch; leave adv.global_norm=false")
    require(adv.lamda == 1.0 or estimator == "gae",
            f"adv.lamda is GAE's lambda; adv.estimator={estimator} has no critic to use it")
    require(adv.gamma == 1.0 or estimator in ("gae", "reinforce_plus_plus", "mc"), f"adv.estimator={estimator} "
            f"scores a whole trajectory at once, so there is nothing to discount; adv.gamma applies to gae, "
            f"reinforce_plus_plus and mc")
    if adv.truncation is not None:
        require(estimator == "mc", "adv.truncation limits the turns of mc's returns; set adv.estimator=mc or drop it")
        require(adv.truncation >= 1, f"adv.truncation={adv.truncation}; give a positive number of turns, or null for "
                                     f"returns to the end of the trajectory")
    if kl.coef > 0 and kl.type == "reward" and kl.estimator != "k1":
        # A penalty in the reward is multiplied by grad log p: only k1 then gives grad KL in
        # expectation (E[k3 grad log p] != grad KL), as REINFORCE++ and OpenAI's PPO use it.
        raise ConfigError(f"actor.kl.type=reward with actor.kl.estimator={kl.estimator} gives a biased KL gradient; "
                          f"use actor.kl.estimator=k1 in the reward, or actor.kl.type=loss with k2/k3")
    if kl.coef > 0 and kl.type == "loss" and kl.estimator == "k1":
        # d/dtheta of mean(log p - log q) over samples of p is mean(grad log p), zero in expectation.
        raise ConfigError("actor.kl.estimator=k1 as a loss has a zero gradient in expectation; use k2 or k3 as a "
                          "loss (actor.kl.type=loss), or put k1 in the reward (actor.kl.type=reward)")


def check_policy_loss(actor) -> None:
    """Fail on a key of one policy loss set while another is selected, and on bounds that clip nothing sensible."""
    read = POLICY_LOSS_KEYS[actor.policy_loss]
    for loss, keys in POLICY_LOSS_KEYS.items():
        for key, default in keys.items():
            value = functools.reduce(getattr, key.split("."), actor)
            if key not in read and value != default:
                others = [name for name, owned in POLICY_LOSS_KEYS.items() if key in owned and name != loss]
                owner = f"{loss} (or {', '.join(others)})" if others else loss
                raise ConfigError(f"actor.{key}={value} belongs to actor.policy_loss={owner}, but actor.policy_loss="
                                  f"{actor.policy_loss}; drop it, or set actor.policy_loss={loss}")
    gspo, cispo = actor.gspo, actor.cispo
    require(actor.dual_clip is None or actor.dual_clip > 1, f"actor.dual_clip={actor.dual_clip}; it bounds the loss "
            f"of a negative-advantage token at dual_clip times its advantage: set it above 1 (3 is a common choice), "
            f"or null for none")
    require(0 <= gspo.clip_low < 1 and gspo.clip_high >= 0, f"actor.gspo.clip_low={gspo.clip_low} must be in [0, 1) "
            f"and actor.gspo.clip_high={gspo.clip_high} at least 0 (the paper: 3e-4 and 4e-4)")
    require(cispo.clip_high >= 0 and (cispo.clip_low is None or 0 <= cispo.clip_low <= 1), f"actor.cispo.clip_high="
            f"{cispo.clip_high} must be at least 0 and actor.cispo.clip_low={cispo.clip_low} in [0, 1] or null (no "
            f"lower bound, as the paper)")
