import os

import pytest

from RL2.config import ConfigError, parse_config
from RL2.config.schema import SFTConfig


def test_defaults_and_overrides():
    cfg = parse_config(SFTConfig, "sft", ["actor.optimizer.lr=3e-4", "trainer.experiment_name=abc"])
    assert cfg.actor.optimizer.lr == pytest.approx(3e-4)
    assert cfg.trainer.save_dir == "ckpts/abc"  # interpolation resolved
    assert cfg.actor.model_name == "smollm2-135m-instruct"


def test_unknown_key_is_named_with_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optimzer'.*actor.optimizer.lr"):
        parse_config(SFTConfig, "sft", ["actor.optimzer.lr=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"'actor.max_grad_norm'.*Float"):
        parse_config(SFTConfig, "sft", ["actor.max_grad_norm=abc"])


def test_value_outside_choices():
    with pytest.raises(ConfigError, match=r"'actor.avg_level' is 'tokens'; choose one of token, sequence, constant"):
        parse_config(SFTConfig, "sft", ["actor.avg_level=tokens"])


def test_argument_without_equals():
    with pytest.raises(ConfigError, match="key=value"):
        parse_config(SFTConfig, "sft", ["actor.dtype"])


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        parse_config(SFTConfig, "sft", ["--help"])
    text = capsys.readouterr().out
    for key in ("data.train.path", "actor.optimizer.lr", "actor.scheduler.min_lr", "trainer.load_ckpt_from"):
        assert key in text


# ---- the RL trainer's policy losses and reference resets: settings that cannot apply fail at start ----

GSPO_RECIPE = ["actor.policy_loss=gspo", "adv.norm_var=true", "actor.avg_level=sequence", "actor.mini_batch_size=2"]
CISPO_RECIPE = ["actor.policy_loss=cispo", "adv.norm_var=true", "actor.avg_level=token", "actor.cispo.clip_high=2"]


def ppo_config(argv):
    from RL2.config.ppo_schema import PPOConfig

    return parse_config(PPOConfig, "ppo", argv)  # the RL trainer's start checks run here too


@pytest.mark.parametrize("argv,message", [
    (["actor.policy_loss=grpo"], "'actor.policy_loss' is 'grpo'; choose one of ppo, gspo, gspo_token, cispo"),
    (["actor.policy_loss=gspo", "actor.clip_high=0.28"], "actor.clip_high=0.28 belongs to actor.policy_loss=ppo"),
    (["actor.policy_loss=cispo", "actor.dual_clip=3"], "actor.dual_clip=3.0 belongs to actor.policy_loss=ppo"),
    (["actor.gspo.clip_low=0.001"], r"actor.gspo.clip_low=0.001 belongs to actor.policy_loss=gspo \(or gspo_token\)"),
    (["actor.policy_loss=gspo", "actor.cispo.clip_high=1"],
     "actor.cispo.clip_high=1.0 belongs to actor.policy_loss=cispo"),
    (["actor.policy_loss=gspo", "actor.gspo.clip_low=1.5"], "actor.gspo.clip_low=1.5 must be in"),
    (["actor.policy_loss=cispo", "actor.cispo.clip_low=2"], "in \\[0, 1\\] or null"),
    (["actor.kl.reset_entropy_floor=1.0"],
     "reset_entropy_floor reset the reference, which exists only with actor.kl.coef > 0"),
    (["actor.kl.coef=0.01", "actor.kl.reset_entropy_floor=0"], "set a positive floor"),
    (["adv.estimator=gae", "critic.update_per_rollout=0"], "critic.update_per_rollout must be at least 1"),
    (["actor.freeze_steps=4"], r"actor\.freeze_steps=4 lets PPO's critic learn.*adv\.estimator=grpo trains no critic"),
    (["adv.estimator=gae", "actor.freeze_steps=-1"], r"actor\.freeze_steps=-1; give the number of steps"),
    (["rollout.test_prompts_per_rollout=0"], r"rollout\.test_prompts_per_rollout=0; test on at least 1 prompt"),
    (["rollout.max_turns=0"], r"rollout\.max_turns=0; a trajectory takes at least 1 action"),
    (["rollout.agent_max_calls=0"], r"rollout\.agent_max_calls=0; give 1 or more, or null for no limit"),
    (["rollout.agent_max_tokens=-5"], r"rollout\.agent_max_tokens=-5; give 1 or more"),
    (["rollout.judge.url=http://h/v1", "rollout.judge.model_path=m"],
     r"rollout\.judge\.url and rollout\.judge\.model_path both give the judge"),
    (["rollout.reward_fn=RL2.rewards:judge_reward"], r"asks the run's judge: set rollout\.judge\.url"),
    (["rollout.judge.score_range=[5,5]"], r"rollout\.judge needs .* score_range \[low, high\] with low < high"),
    (["rollout.train_sampling_params.max_new_tokens=0"],
     r"rollout\.train_sampling_params\.max_new_tokens=0; an action needs at least 1 new token"),
    (["rollout.train_sampling_params.temperature=-1"], r"rollout\.train_sampling_params\.temperature=-1\.0; give 0"),
    (["rollout.train_sampling_params.temperature=0"],
     r"rollout\.train_sampling_params\.temperature=0\.0 samples greedily.*Give a positive temperature"),
    (["rollout.test_sampling_params.top_p=0"], r"rollout\.test_sampling_params\.top_p=0\.0; .*set it in \(0, 1\]"),
    (["rollout.train_sampling_params.stop=['</a>','']"], r"rollout\.train_sampling_params\.stop=.*non-empty strings"),
    (["rollout.test_sampling_params.no_stop_trim=false"],
     r"rollout\.test_sampling_params\.no_stop_trim=false.*drop it"),
])
def test_policy_loss_and_reset_settings_that_cannot_apply_fail(argv, message):
    with pytest.raises(ConfigError, match=message):
        ppo_config(argv)


@pytest.mark.parametrize("argv", [GSPO_RECIPE, CISPO_RECIPE,
                                  ["actor.policy_loss=gspo_token", "actor.gspo.clip_high=0.001"],
                                  ["actor.clip_high=0.28", "actor.dual_clip=3"],
                                  ["actor.kl.coef=0.01", "actor.kl.reset_entropy_floor=0.3"],
                                  ["adv.estimator=gae", "actor.freeze_steps=4", "rollout.test_prompts_per_rollout=8"]])
def test_policy_loss_recipes_pass(argv):
    ppo_config(argv)


PARTIAL = ["rollout.partial_rollout=true"]


@pytest.mark.parametrize("argv,message", [
    (PARTIAL, r"rollout\.partial_rollout trains on tokens sampled by weights up to any number of updates old, with "
              r"no correction for it: set actor\.correction\.type .*actor\.tis_coef=2 is tis"
              r".*rollout\.max_staleness=0"),
    (PARTIAL + ["rollout.max_staleness=2"], r"up to 2 updates old, with no correction"),
    (["rollout.over_sampling=4"], r"rollout\.over_sampling=4 starts groups beyond the batch for a partial rollout"),
    (PARTIAL + ["rollout.over_sampling=-1"], r"rollout\.over_sampling=-1; give the groups"),
    (["rollout.max_staleness=1"], r"rollout\.max_staleness=1 bounds how old the groups a partial rollout carries"),
    (PARTIAL + ["rollout.max_staleness=-1"], r"rollout\.max_staleness=-1; give the most updates"),
    (PARTIAL + ["rollout.max_staleness=1", "actor.tis_coef=2", "rollout.weight_sync=none"],
     r"rollout\.max_staleness=1 with rollout\.weight_sync=none"),
    (["actor.tis_coef=2", "actor.correction.type=icepop"], r"actor\.tis_coef=2\.0 is the short form of "
                                                           r"actor\.correction\.type=tis"),
    (["actor.correction.type=tis", "actor.correction.low=0.5"], r"actor\.correction\.low=0\.5 means nothing for "
                                                                 r"actor\.correction\.type=tis"),
    (["actor.correction.high=3"], r"actor\.correction\.high=3\.0 bounds a correction; set actor\.correction\.type"),
    (["actor.correction.type=icepop", "actor.correction.low=6"],
     r"actor\.correction bounds \[6\.0, 5\.0\] keep no ratio"),
    (["actor.correction.type=seq_mask", "actor.correction.high=-1"], r"high must be positive and low at least 0"),
    (["actor.correction.type=ice"],
     r"'actor\.correction\.type' is 'ice'; choose one of none, tis, icepop, seq_mask"),
    (PARTIAL + ["rollout.agent_path=envs/tool_use_agent.py", "rollout.over_sampling=4", "rollout.max_staleness=1",
                "actor.correction.type=icepop"],
     r"rollout\.partial_rollout=true with rollout\.agent_path=envs/tool_use_agent\.py: .* cannot be carried over "
     r"one nor kept in a checkpoint \(docs/async\.md, \"Agents\"\); drop rollout\.partial_rollout \(with "
     r"rollout\.over_sampling and rollout\.max_staleness\), or roll out an environment \(rollout\.env_path\)"),
])
def test_staleness_and_correction_settings_that_cannot_apply_fail(argv, message):
    with pytest.raises(ConfigError, match=message):
        ppo_config(argv)


@pytest.mark.parametrize("argv", [
    PARTIAL + ["actor.tis_coef=2"],  # today's partial rollout with today's correction
    PARTIAL + ["rollout.max_staleness=0"],  # nothing older than the current weights is trained: nothing to correct
    PARTIAL + ["rollout.over_sampling=8", "rollout.max_staleness=1", "actor.correction.type=icepop"],
    PARTIAL + ["rollout.max_staleness=2", "actor.correction.type=geo_mask", "actor.correction.high=1.01"],
    ["actor.correction.type=seq_mask", "actor.correction.low=0", "actor.correction.high=2"],
])
def test_bounded_and_corrected_partial_rollouts_pass(argv):
    ppo_config(argv)


def test_stop_strings_reach_the_engines_in_the_original_spellings():
    from RL2.rollout.loop import engine_sampling_params

    # The original RL2's Search-R1 lines, key for key.
    cfg = ppo_config(["rollout.train_sampling_params.stop=['</search>','</answer>']",
                      "rollout.train_sampling_params.no_stop_trim=true", "rollout.test.sampling_params.stop=</answer>"])
    train = engine_sampling_params(cfg.rollout.train_sampling_params)
    assert (train["stop"], "no_stop_trim" in train, "stop_token_ids" in train) == (
        ["</search>", "</answer>"], False, False)
    assert engine_sampling_params(cfg.rollout.test_sampling_params)["stop"] == ["</answer>"]
    cfg = ppo_config(["rollout.train_sampling_params.stop_token_ids=[2,7]"])
    assert engine_sampling_params(cfg.rollout.train_sampling_params)["stop_token_ids"] == [2, 7]
    assert "stop" not in engine_sampling_params(cfg.rollout.test_sampling_params)


def test_gspo_and_cispo_defaults_are_the_papers():
    cfg = ppo_config(["actor.policy_loss=gspo"])
    assert (cfg.actor.gspo.clip_low, cfg.actor.gspo.clip_high) == (3e-4, 4e-4)  # GSPO sec. 5.1
    assert cfg.actor.cispo.clip_low is None  # MiniMax-M1 bounds the weight from above only


def test_every_registry_serves_exactly_the_choices_its_key_declares():
    """Where a config string meets code, the registry and the schema's choices name the same things."""
    from RL2.algs.kl import KL_ESTIMATORS
    from RL2.algs.policy_loss import CORRECTIONS
    from RL2.config.cli import all_keys
    from RL2.config.ppo_schema import CORRECTION_BOUNDS, PPOConfig
    from RL2.trainer.ppo_advantages import ESTIMATORS
    from RL2.workers.actor import POLICY_LOSSES

    choices = {key.name: set(key.choices) for key in all_keys(PPOConfig) if key.choices}
    assert choices["adv.estimator"] == set(ESTIMATORS)
    assert choices["actor.policy_loss"] == set(POLICY_LOSSES)
    assert choices["actor.kl.estimator"] == set(KL_ESTIMATORS)
    assert choices["actor.correction.type"] - {"none"} == set(CORRECTIONS) == set(CORRECTION_BOUNDS)


# ---- values out of range fail at start, naming the key; documented "off" values pass ----


@pytest.mark.parametrize("argv,message", [
    (["data.train.batch_size=0"], r"data\.train\.batch_size=0; it must be at least 1"),
    (["data.test.batch_size=-4"], r"data\.test\.batch_size=-4; it must be at least 1"),
    (["data.train.max_length=0"], r"data\.train\.max_length=0; it must be at least 1"),
    (["data.test_ratio=1.5"], r"data\.test_ratio=1\.5; .*set it in \[0, 1\)"),
    (["data.test_ratio=1"], r"data\.test_ratio=1\.0; .*set it in \[0, 1\)"),
    (["data.test_ratio=-0.2"], r"data\.test_ratio=-0\.2; .*set it in \[0, 1\)"),
    (["trainer.save_freq=-1"], r"trainer\.save_freq=-1; give a number of steps \(null or 0: never\)"),
    (["trainer.test_freq=-5"], r"trainer\.test_freq=-5; give a number of steps"),
    (["trainer.keep_last_n=0"], r"trainer\.keep_last_n=0; keep at least 1 checkpoint \(the latest\), or null"),
    (["actor.max_length_per_device=0"], r"actor\.max_length_per_device=0; .*token budget"),
    (["trainer.n_epochs=0"], r"trainer\.n_epochs=0; it must be at least 1"),
    (["trainer.total_steps=-3"], r"trainer\.total_steps=-3; give at least 1 step"),
    (["actor.optimizer.lr=-1"],
     r"actor\.optimizer\.lr=-1\.0, eps=1e-08, weight_decay=0\.0; none of them can be negative"),
    (["actor.optimizer.betas=[0.9]"],
     r"actor\.optimizer\.betas=\[0\.9\]; AdamW takes two decay rates, each in \[0, 1\)"),
    (["actor.optimizer.betas=[0.9,1.5]"], r"actor\.optimizer\.betas=\[0\.9, 1\.5\]; AdamW takes two"),
    (["actor.scheduler.warmup_ratio=2"], r"actor\.scheduler\.warmup_ratio=2\.0; .*set it in \[0, 1\]"),
])
def test_out_of_range_values_name_the_key(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(SFTConfig, "sft", argv)


def test_off_and_boundary_values_pass():
    cfg = parse_config(SFTConfig, "sft", ["trainer.save_freq=0", "trainer.test_freq=0", "data.test_ratio=0",
                                          "data.train.batch_size=1"])
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq, cfg.data.test_ratio, cfg.data.train.batch_size) == (
        0, 0, 0, 1)
    assert parse_config(SFTConfig, "sft", ["data.test_ratio=0.99"]).data.test_ratio == pytest.approx(0.99)


def test_the_evaluator_config_passes_the_range_checks():
    from RL2.config.eval_schema import EvalConfig

    cfg = parse_config(EvalConfig, "eval", ["data.test.path=t.jsonl"])
    assert cfg.data.test.path == "t.jsonl"
    with pytest.raises(ConfigError, match=r"data\.test\.max_length=0"):
        parse_config(EvalConfig, "eval", ["data.test.max_length=0"])


def test_resume_without_a_checkpoint_fails_before_any_model_is_built(tmp_path, monkeypatch):
    from RL2.trainer import sft

    def build(*args, **kwargs):
        raise AssertionError("the tokenizer or model was loaded before trainer.load_ckpt_from was checked")

    monkeypatch.setattr(sft, "load_tokenizer", build)
    monkeypatch.setattr(sft, "FSDPWorker", build)
    save_dir = tmp_path / "run"
    (save_dir / "step2").mkdir(parents=True)  # a save that did not finish: no trainer_state.json
    argv = [f"trainer.save_dir={save_dir}", "data.train.path=unused.jsonl"]
    with pytest.raises(SystemExit, match=rf"RL2 sft: trainer\.load_ckpt_from=latest: trainer\.save_dir={save_dir} "
                                         r"holds no complete checkpoint.*leave trainer\.load_ckpt_from unset"):
        sft.main(argv + ["trainer.load_ckpt_from=latest"])
    with pytest.raises(SystemExit, match=r"trainer\.load_ckpt_from=lastest: neither lastest nor .*run/lastest exists; "
                                         r"give 'latest' or a step<N> folder"):
        sft.main(argv + ["trainer.load_ckpt_from=lastest"])
    with pytest.raises(SystemExit, match=r"trainer\.load_ckpt_from=step2: .*step2 is not a complete checkpoint"):
        sft.main(argv + ["trainer.load_ckpt_from=step2"])


# ---- a student's mistakes at start end with a message naming the key, before any model is loaded ----


@pytest.fixture
def one_process():
    """`main()` called in this process: the one-rank group it makes sets RANK, LOCAL_RANK and WORLD_SIZE, which
    must not make the next call think it runs under torchrun."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def refuse_models(monkeypatch):
    """Make loading a tokenizer or a model fail the test: the mistake must be caught before either."""
    import importlib

    def build(*args, **kwargs):
        raise AssertionError("a tokenizer or model was loaded before the mistake was caught")

    for trainer in ("sft", "pairwise", "dpo", "orpo", "rm", "distill"):
        module = importlib.import_module(f"RL2.trainer.{trainer}")
        for name in ("load_tokenizer", "FSDPWorker"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, build)


def test_an_unset_train_path_names_the_key(tmp_path, monkeypatch, tok, one_process):
    from RL2.trainer import sft

    monkeypatch.setattr(sft, "load_tokenizer", lambda cfg, section: tok)
    monkeypatch.setattr(sft, "FSDPWorker", lambda *args, **kwargs: pytest.fail("the model was built without data"))
    with pytest.raises(SystemExit, match=r"RL2 sft: data\.train\.path is not set; give the training rows"):
        sft.main([f"trainer.save_dir={tmp_path / 'run'}"])


@pytest.mark.parametrize("arg,message", [
    ("rollout.env_path=envs/aritmetic.py",
     r"rollout\.env_path=envs/aritmetic\.py: environment script envs/aritmetic\.py does not exist"),
    ("rollout.reward_fn=my_reward.py:reward", r"rollout\.reward_fn: my_reward\.py does not exist"),
    # no default environment: a run that names none stops before any model is built
    ("trainer.seed=1", r"rollout\.env_path is not set; give the environment script.*rollout\.reward_fn=FILE:NAME"),
])
def test_a_missing_environment_or_reward_file_names_the_key(arg, message, tmp_path, monkeypatch, one_process):
    from RL2.trainer import ppo

    monkeypatch.setattr(ppo, "load_tokenizer", lambda cfg, section: None)
    with pytest.raises(SystemExit, match=rf"RL2 ppo: {message}"):
        ppo.main(["data.train.path=unused.jsonl", f"trainer.save_dir={tmp_path / 'run'}", arg])


@pytest.mark.parametrize("trainer,argv,message", [
    ("dpo", ["actor.label_smoothing=0.5"], r"actor\.label_smoothing=0\.5; .*in \[0, 0\.5\)"),
    ("dpo", ["actor.beta=0"], r"actor\.beta=0\.0; .*positive"),
    ("dpo", ["actor.beta=-0.1", "actor.loss_type=ipo"], r"actor\.beta=-0\.1; .*positive"),
    ("distill", ["actor.temperature=0"], r"actor\.temperature=0\.0; .*positive"),
])
def test_loss_settings_that_cannot_train_fail_at_start(trainer, argv, message, tmp_path, monkeypatch, one_process):
    import importlib

    module = importlib.import_module(f"RL2.trainer.{trainer}")
    refuse_models(monkeypatch)
    with pytest.raises(SystemExit, match=rf"RL2 {trainer}: {message}"):
        module.main(["data.train.path=unused.jsonl", f"trainer.save_dir={tmp_path / 'run'}", *argv])


def test_a_save_dir_that_cannot_be_made_names_the_key(tmp_path, monkeypatch, one_process):
    from RL2.trainer import sft

    refuse_models(monkeypatch)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit, match=rf"RL2 sft: trainer\.save_dir={blocker}/run: cannot create it "
                                         r"\(Not a directory: .*\); give a folder this user can write"):
        sft.main(["data.train.path=unused.jsonl", f"trainer.save_dir={blocker}/run"])


def test_a_model_folder_that_is_not_there_names_the_key(tmp_path, one_process):
    """transformers reads a missing folder as a malformed hub id ('Repo id must be in the form ...')."""
    from RL2.trainer import sft

    missing = tmp_path / "ckpts" / "sft" / "final" / "actr"
    with pytest.raises(SystemExit, match=rf"^RL2 sft: actor\.model_name={missing}: cannot load it: no such folder, "
                                         r"nor a model of that name in the local Hugging Face cache \(.*\); give a "
                                         r"Hugging Face model folder"):
        sft.main(["data.train.path=unused.jsonl", f"trainer.save_dir={tmp_path / 'run'}",
                  f"actor.model_name={missing}"])


def test_a_teacher_folder_that_is_not_there_names_it(tiny_model_path, tmp_path, one_process):
    from RL2.trainer import distill

    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "1 + 1?", "response": "2"}\n')
    missing = tmp_path / "teacher"
    with pytest.raises(SystemExit, match=rf"^RL2 distill: the model {missing}: cannot load it: no such folder"):
        distill.main([f"data.train.path={data}", "data.train.batch_size=1", f"actor.model_name={tiny_model_path}",
                      f"actor.teacher_name={missing}", "actor.dtype=float32", f"trainer.save_dir={tmp_path / 'run'}"])
