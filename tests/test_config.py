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
