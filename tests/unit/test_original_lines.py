"""Command lines written for RL2's original releases.

Every example line of the original's history (`tests/data/original_example_lines.txt`, verbatim) goes
through the real command line (`parse_config`, which runs every trainer's start checks):
it parses and starts, or fails naming the key and what to do (the lines that cannot run are listed in
`CANNOT_RUN`, with why). A line written for the original keeps the original's meaning of the keys it
shares with RL2 (`RL2.compat.command_lines`), which the tests below compare with the original's own
code, quoted where it matters; a line of RL2's own keys keeps RL2's.
"""

import re
import shlex
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from RL2.compat.command_lines import ORIGINAL_DEFAULTS
from RL2.config import ConfigError, parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.config.schema import DPOConfig, RMConfig, SFTConfig
from tests.helpers import TESTS

LINES_FILE = TESTS / "data" / "original_example_lines.txt"
SCHEMAS = {"ppo": PPOConfig, "sft": SFTConfig, "dpo": DPOConfig, "rm": RMConfig}


@dataclass
class OriginalLine:
    """One example line: where it comes from ("<commit> <date> <script> (<releases>)") and what it runs."""

    source: str
    trainer: str
    args: list[str]

    @property
    def id(self) -> str:
        commit, _, script = self.source.split()[:3]
        return f"{script.rsplit('/', 1)[1].removesuffix('.sh')}@{commit}"

    def released_in(self, release: str) -> bool:
        return release in self.source


def original_lines() -> list[OriginalLine]:
    lines, source = [], None
    for text in LINES_FILE.read_text().splitlines():
        if text.startswith("# ") and re.match(r"# [0-9a-f]{7} ", text):
            source = text[2:]
        elif text and not text.startswith("#"):
            module, *args = shlex.split(text)
            lines.append(OriginalLine(source, module.rsplit(".", 1)[1], args))
    return lines


LINES = original_lines()

# What makes a line fail, and the message it fails with.
CANNOT_RUN = {
    # May 2025, before any release: a reward function of (messages, answer), not an environment script
    "actor.rollout.reward_fn_path": r"'actor.rollout.reward_fn_path'.*rollout.reward_fn=FILE:NAME",
    # November 2025: a misspelt key, which the original's Hydra config refused too (it had test_prompts_per_rollout)
    "rollout.test_prompts_per_prompt": r"unknown config key 'rollout.test_prompts_per_prompt'.*did you mean "
                                       r"rollout.test_prompts_per_rollout",
    # December 2025 searchr1.sh sets rollout.train.path twice; the second was meant to be rollout.test.path
    "rollout.train.path": r"config key 'rollout.train.path' is given twice",
}


def failure_of(line: OriginalLine) -> str | None:
    keys = [arg.split("=")[0] for arg in line.args]
    for key, message in CANNOT_RUN.items():
        if key in keys and (key != "rollout.train.path" or keys.count(key) > 1):
            return message
    return None


def start(line: OriginalLine, capsys=None):
    """The line's config as the trainer would start with it (its start checks passed)."""
    return parse_config(SCHEMAS[line.trainer], line.trainer, line.args)


def test_the_history_is_all_there():
    assert len(LINES) == 116
    assert {line.trainer for line in LINES} == set(SCHEMAS)
    assert sum(line.released_in("0.0.1.post1") for line in LINES) == 8
    assert sum(line.released_in("0.0.2") for line in LINES) == 8
    assert sum(line.released_in("January 2026 main") for line in LINES) == 9


@pytest.mark.parametrize("line", LINES, ids=[line.id for line in LINES])
def test_every_original_line_starts_or_fails_naming_the_key(line, capsys):
    failure = failure_of(line)
    if failure:
        with pytest.raises(ConfigError, match=failure):
            start(line)
        return
    cfg = start(line)
    out = capsys.readouterr().out
    # Every line names an environment or its data, and every alias it used said so in a line of its own.
    if line.trainer == "ppo":
        assert cfg.rollout.env_path or cfg.data.train.path
    assert all(text.startswith("[RL2] ") for text in out.splitlines())


def line_of(script: str, release: str) -> OriginalLine:
    return next(line for line in LINES if f"examples/{script}.sh" in line.source and line.released_in(release))


def test_countdown_of_the_releases_means_what_it_meant(capsys):
    cfg = start(line_of("countdown_reinforce", "0.0.2"))
    assert (cfg.data.train.path, cfg.data.test.path) == ("train@Chenmien/Countdown", "test@Chenmien/Countdown")
    assert (cfg.data.train.batch_size, cfg.rollout.responses_per_prompt) == (128, 4)
    assert cfg.rollout.env_path == "envs/countdown.py"
    # The original's test_sampling_params took the train ones' max_new_tokens and stop
    # (`max_new_tokens: ${rollout.train_sampling_params.max_new_tokens}`, `stop: ${...stop}`).
    for params in (cfg.rollout.train_sampling_params, cfg.rollout.test_sampling_params):
        assert (params.max_new_tokens, list(params.stop)) == (1024, ["</answer>"])
    assert cfg.rollout.test_sampling_params.temperature == 0.0
    out = capsys.readouterr().out
    assert "the test split follows the train split's settings" in out
    # One line names the defaults that differ, each with the original's value.
    [defaults] = [text for text in out.splitlines() if "RL2's defaults differ" in text]
    assert "rollout.dynamic_filtering=false (original: true)" in defaults
    assert "actor.enable_gradient_checkpointing=false (original: true)" in defaults
    assert "rollout.responses_per_prompt" not in defaults  # the line sets it


def test_orz_ppo_of_the_releases_warms_up_its_critic_and_whitens_gae():
    cfg = start(line_of("orz_ppo", "0.0.2"))
    assert (cfg.adv.estimator, cfg.actor.freeze_steps, cfg.actor.cp_size) == ("gae", 4, 2)
    # compute_gae: `advantages = (gaes - action_gaes.mean()) ... / (action_gaes.std() + eps)`, always
    assert cfg.adv.global_norm
    assert (cfg.data.train.batch_size, cfg.rollout.responses_per_prompt) == (128, 64)
    assert cfg.critic.cp_size == 2  # critic.sp_size: ${actor.sp_size}; RL2 needs one layout for both


def test_gem_of_the_releases_takes_the_batch_as_baseline():
    cfg = start(line_of("gem_reinforce", "0.0.2"))
    assert cfg.data.train.path is None and cfg.rollout.env_path == "envs/gem.py"  # the env's reset makes the prompts
    assert (cfg.data.train.batch_size, cfg.rollout.test_prompts_per_rollout) == (64, 64)
    # compute_reinforce_adv with global_norm: `baseline = rewards.mean(); std = rewards.std()`
    assert (cfg.adv.baseline, cfg.adv.norm_var, cfg.adv.global_norm) == ("batch", True, False)


def test_countdown_of_january_2026_keeps_its_test_split_as_its_train_split():
    cfg = start(line_of("countdown_reinforce", "January 2026 main"))
    # rollout.test.apply_chat_template: ${rollout.train.apply_chat_template}
    assert not cfg.data.train.apply_chat_template and not cfg.data.test.apply_chat_template
    assert list(cfg.rollout.test_sampling_params.stop) == ["</answer>"]


def test_deep_research_evaluation_evaluates_the_model_its_server_ran():
    cfg = start(line_of("deepresearch_eval", "January 2026 main"))
    assert cfg.actor.model_name == "Alibaba-NLP/Tongyi-DeepResearch-30B-A3B"
    assert (cfg.trainer.eval_only, cfg.rollout.test_prompts_per_rollout) == (True, 32)
    assert cfg.rollout.test_sampling_params.temperature == 0.7


def test_january_2026_sft_dpo_rm_lines_are_rl2_keys_with_rl2_defaults(capsys):
    for script in ("limo_sft", "ultrafeedback_dpo", "skywork_rm"):
        line = line_of(script, "January 2026 main")
        cfg = start(line)
        assert capsys.readouterr().out == ""  # nothing tells them from RL2's own lines
        assert cfg.data.train.path.startswith("Chenmien/")


# ---- the original's meaning of keys RL2 shares, on lines written for the original -----------------------

ORIGINAL = ["train_data.path=rl.jsonl"]  # a key only the original had: the line is the original's


def ppo(argv, capsys=None):
    return parse_config(PPOConfig, "ppo", argv)


def test_update_per_rollout_is_one_pass_in_that_many_steps(capsys):
    # The original split each rollout into update_per_rollout mini-batches, one optimizer step each.
    cfg = ppo(ORIGINAL + ["train_data.prompts_per_rollout=64", "actor.update_per_rollout=4", "adv.estimator=gae"])
    for model in (cfg.actor, cfg.critic):  # critic.update_per_rollout: ${actor.update_per_rollout}
        assert (model.update_per_rollout, model.mini_batch_size) == (1, 16)
    assert "'actor.update_per_rollout=4' keeps the original's meaning" in capsys.readouterr().out
    rl2 = ppo(["data.train.batch_size=64", "actor.update_per_rollout=4"])  # RL2's own line: 4 passes
    assert (rl2.actor.update_per_rollout, rl2.actor.mini_batch_size) == (4, None)


@pytest.mark.parametrize("argv,baseline,global_norm", [
    (["adv.global_norm=true"], "batch", False),
    (["train_data.responses_per_prompt=1"], "batch", False),
    (["adv.global_norm=true", "adv.estimator=gae"], "group", True),
    ([], "group", False),
])
def test_global_norm_and_one_response_take_the_batch_mean_as_baseline(argv, baseline, global_norm):
    cfg = ppo(ORIGINAL + argv)
    assert (cfg.adv.baseline, cfg.adv.global_norm) == (baseline, global_norm)
    if argv[:1] == ["adv.global_norm=true"] and baseline == "batch":  # RL2's own line whitens instead
        rl2 = ppo(argv)
        assert (rl2.adv.baseline, rl2.adv.global_norm) == ("group", True)


def test_dynamic_filtering_drops_groups_without_drawing_more():
    cfg = ppo(ORIGINAL + ["rollout.dynamic_filtering=true"])
    assert (cfg.rollout.dynamic_filtering, cfg.rollout.max_sampling_rounds) == (True, 1)
    assert ppo(["rollout.dynamic_filtering=true"]).rollout.max_sampling_rounds > 1  # RL2's resamples


@pytest.mark.parametrize("place,estimator", [("reward", "k1"), ("loss", "k2")])
def test_a_kl_type_without_estimator_takes_the_originals_default(place, estimator, capsys):
    # ppo.yaml: kl.reward_estimator: k1, kl.loss_estimator: k2
    cfg = ppo(ORIGINAL + ["actor.kl.coef=0.001", f"actor.kl.type={place}"])
    assert cfg.actor.kl.estimator == estimator
    assert f"actor.kl.type={place} without an estimator takes the original's default" in capsys.readouterr().out
    if place == "reward":  # RL2's default k3 is refused in the reward
        with pytest.raises(ConfigError, match="actor.kl.type=reward with actor.kl.estimator=k3"):
            ppo(["actor.kl.coef=0.001", "actor.kl.type=reward"])


def test_the_test_split_follows_only_what_the_line_leaves_out():
    cfg = ppo(ORIGINAL + ["rollout.train.sampling_params.max_new_tokens=512", "rollout.train.apply_chat_template=false",
                          "rollout.test.sampling_params.max_new_tokens=64"])
    assert (cfg.rollout.train_sampling_params.max_new_tokens, cfg.rollout.test_sampling_params.max_new_tokens) == (
        512, 64)
    assert not cfg.data.test.apply_chat_template


def test_the_defaults_line_names_only_keys_left_out(capsys):
    ppo(ORIGINAL + ["actor.weight_decay=0.01", "trainer.disable_wandb=true"])
    [defaults] = [text for text in capsys.readouterr().out.splitlines() if "RL2's defaults differ" in text]
    assert "weight_decay" not in defaults and "use_wandb" not in defaults
    for key, value in ORIGINAL_DEFAULTS["ppo"].items():
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert key in ("actor.optimizer.weight_decay", "trainer.use_wandb") or f"{key}=" in defaults and (
            f"(original: {shown})" in defaults)


def test_rl2_lines_print_nothing_and_keep_rl2_meanings(capsys):
    cfg = ppo(["data.train.path=rl.jsonl", "rollout.env_path=envs/countdown.py", "adv.estimator=gae",
               "rollout.train_sampling_params.max_new_tokens=512"])
    assert capsys.readouterr().out == ""
    assert not cfg.adv.global_norm and cfg.rollout.test_sampling_params.max_new_tokens == 256
    assert OmegaConf.to_container(cfg.data.test) == OmegaConf.to_container(parse_config(PPOConfig, "ppo", []).data.test)
