"""trainer.collective_timeout: a rank waiting in a collective for a rank that never comes stops after it,
on every process group (`RL2.parallel.init_distributed`); and its default and bounds (`collective_timeout`)."""

import json

import pytest
from omegaconf import OmegaConf

from RL2.config import ConfigError
from RL2.config.cli import parse_config
from RL2.config.eval_schema import EvalConfig
from RL2.config.ppo_schema import PPOConfig
from RL2.config.schema import SFTConfig
from RL2.parallel import collective_timeout
from tests.helpers.launch import run_ranks


def test_a_collective_waits_trainer_collective_timeout_on_every_group(tmp_path):
    out = tmp_path / "waits.json"
    run_ranks(2, ["tests/e2e/scripts/collective_timeout.py", str(out), "trainer.collective_timeout=4"], timeout=240)
    waits = json.loads(out.read_text())
    for name in ("world", "later"):  # torch's default: 1800 s; rank 1 stays away for up to 60 s
        assert waits[name]["error"] is not None and 4 <= waits[name]["seconds"] < 30, waits


def test_the_default_outlasts_a_generation_request():
    assert collective_timeout(parse_config(SFTConfig, "sft", [])) == 1800
    assert collective_timeout(parse_config(PPOConfig, "ppo", [])) == 3600 + 600  # rollout.request_timeout's default
    assert collective_timeout(parse_config(PPOConfig, "ppo", ["rollout.request_timeout=60"])) == 1800
    assert collective_timeout(parse_config(PPOConfig, "ppo", ["trainer.collective_timeout=7200"])) == 7200
    evaluation = OmegaConf.structured(EvalConfig)
    evaluation.rollout.request_timeout = 7200.0
    assert collective_timeout(evaluation) == 7800
    with pytest.raises(ConfigError, match=r"trainer\.collective_timeout=1800.0 s is shorter than "
                                          r"rollout\.request_timeout=3600.0 s plus 600 s.*at least 4200"):
        parse_config(PPOConfig, "ppo", ["trainer.collective_timeout=1800"])
