"""Typed config of the evaluator (`python -m RL2.evaluate`, `RL2.evaluate(...)`): its `rollout` keys are the RL
trainer's, less those only training uses, so a PPO command line's settings carry over."""

import dataclasses
from dataclasses import dataclass

from RL2.config.errors import require
from RL2.config.ppo_schema import RolloutConfig, TestSamplingConfig, check_rollout
from RL2.config.schema import opt

# RolloutConfig keys that mean nothing in an evaluation: training's sampling and shaping, and the
# weight sync (the evaluated weights never change; the engine gets `weight_sync=none`).
TRAINING_ONLY = frozenset({
    "responses_per_prompt", "test_responses_per_prompt", "test_prompts_per_rollout", "train_sampling_params",
    "test_sampling_params", "dynamic_filtering", "max_sampling_rounds", "partial_rollout", "overlong_buffer_len",
    "overlong_penalty_factor", "length_penalty_coef", "reward_model", "save_samples", "weight_sync",
    "weight_bucket_mb", "weights_dir", "check_weight_sync", "over_sampling", "max_staleness",
})


EvalRolloutConfig = dataclasses.make_dataclass("EvalRolloutConfig", [
    ("responses_per_prompt", int, opt(1, "samples per prompt (pass@k uses all of them)")),
    ("sampling_params", TestSamplingConfig,
     opt(TestSamplingConfig, "sampling of every sample (temperature 0 is greedy)")),
    *((f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
      for f in dataclasses.fields(RolloutConfig) if f.name not in TRAINING_ONLY),
])


@dataclass
class EvalModelConfig:
    model_name: str = opt("smollm2-135m-instruct", "the model: HF folder (e.g. a trainer's <save_dir>/final/actor) or "
                          "name in the local cache; 'smollm2-135m-instruct' is the bundled default model")
    tokenizer_name: str | None = opt(None, "tokenizer to load; defaults to model_name")
    dtype: str = opt("auto", "the engine's dtype: auto (bfloat16 where its matmuls are native and faster than float32, "
                     "else float32) | bfloat16 | float16 | float32", choices=("auto", "bfloat16", "float16", "float32"))


@dataclass
class CompareConfig:
    model_name: str | None = opt(None, "a second model, evaluated on the same prompts with the same sampling and "
                                 "seeds; the report shows both and model - compare (None: no comparison)")
    tokenizer_name: str | None = opt(None, "its tokenizer; defaults to compare.model_name")


@dataclass
class EvalSplitConfig:
    path: str | None = opt(None, "test prompts (RL rows: prompt or messages, extra_info): JSON/JSONL/CSV/Parquet/Arrow "
                           "file, save_to_disk folder or hub name in the local cache; 'split@path' picks a split")
    max_length: int = opt(1024, "prompts longer than this many tokens are bad rows")
    prompt_key: str = opt("prompt", "column holding the prompt (text, or a list of chat messages)")
    messages_key: str = opt("messages", "column holding the conversation so far")
    apply_chat_template: bool = opt(True, "format text prompts with the tokenizer's chat template")


@dataclass
class EvalDataConfig:
    test: EvalSplitConfig = opt(EvalSplitConfig, "the test split, under the RL trainer's key names")
    max_prompts: int | None = opt(None, "evaluate only the first this many rows (None: all)")
    skip_bad_rows: bool = opt(False, "skip (and count) malformed rows instead of stopping with an error")


@dataclass
class EvalSettings:
    k: list[int] = opt([], "pass@k for each of these k (unbiased estimator of Chen et al. 2021); empty: k = "
                       "rollout.responses_per_prompt")
    threshold: float = opt(1.0, "a sample passes when its score is at least this; accuracy is the share that pass")
    save_dir: str = opt("evals/run", "folder of samples.jsonl (every sample) and metrics.json")
    seed: int = opt(42, "seed of the sampling: sample j of prompt i draws from its own seed, the same for both models "
                    "and on any number of ranks")
    device: str = opt("auto", "auto | cpu | cuda", choices=("auto", "cpu", "cuda"))


@dataclass
class EvalConfig:
    model: EvalModelConfig = opt(EvalModelConfig, "the evaluated model")
    compare: CompareConfig = opt(CompareConfig, "a second model to compare with")
    data: EvalDataConfig = opt(EvalDataConfig, "test prompts")
    rollout: EvalRolloutConfig = opt(EvalRolloutConfig, "environment or reward function, engine and sampling (the RL "
                                     "trainer's rollout keys)")
    eval: EvalSettings = opt(EvalSettings, "metrics, outputs and seed")


def check_eval_config(cfg) -> None:
    """Fail at start on a value the evaluator cannot use, naming the key."""
    n = cfg.rollout.responses_per_prompt
    require(cfg.data.test.path, "data.test.path is not set; give the test prompts, e.g. data.test.path=test.jsonl")
    require(n >= 1, f"rollout.responses_per_prompt is {n}; it must be at least 1")
    check_rollout(cfg.rollout, ("sampling_params",))
    bad = [k for k in cfg.eval.k if not 1 <= k <= n]
    require(not bad, f"eval.k has {bad}: pass@k needs 1 <= k <= rollout.responses_per_prompt={n}; raise "
                     f"rollout.responses_per_prompt or lower k")
