"""Checks of config values alone fail when the command line is parsed, before any trainer, model, engine
or environment is built: `parse_config` is all these tests call."""

import dataclasses

import pytest

from RL2.api import SCHEMAS
from RL2.config import ConfigError, parse_config
from RL2.config.ppo_schema import PPOConfig

SERVER = "rollout.server_url=http://localhost:30000"


@pytest.mark.parametrize("trainer,argv,message", [
    ("sft", ["actor.avg_level=constant"],
     r"actor\.avg_level=constant divides by the generation budget, which only RL has"),
    ("distill", ["actor.avg_level=constant"], r"actor\.avg_level=constant divides by the generation budget"),
    ("distill", ["actor.temperature=0"], r"actor\.temperature=0\.0; .*set a positive temperature"),
    ("dpo", ["actor.avg_level=sequence"], r"actor\.avg_level=sequence: a preference loss is one number per pair"),
    ("orpo", ["actor.avg_level=constant"], r"actor\.avg_level=constant: a preference loss is one number per pair"),
    ("rm", ["critic.avg_level=sequence"], r"critic\.avg_level=sequence: a preference loss is one number per pair"),
    ("dpo", ["actor.beta=0"], r"actor\.beta=0\.0; DPO needs a positive beta"),
    ("dpo", ["actor.label_smoothing=0.5"], r"actor\.label_smoothing=0\.5; .*set it in \[0, 0\.5\)"),
    ("ppo", ["rollout.max_turns=0"], r"rollout\.max_turns=0; a trajectory takes at least 1 action"),
    ("ppo", ["actor.dual_clip=0.5"], r"actor\.dual_clip=0\.5; .*set it above 1"),
    ("ppo", ["adv.estimator=mc", "adv.truncation=0"], r"adv\.truncation=0; give a positive number of turns"),
    ("ppo", [SERVER, "rollout.engine=embedded"], r"rollout\.server_url is set but rollout\.engine=embedded"),
    ("ppo", ["rollout.server_url=localhost:30000"], r"'rollout\.server_url' has 'localhost:30000'; give URLs like"),
    ("ppo", ["rollout.server_env.SGLANG_RETURN_ORIGINAL_LOGPROB=true"],
     r"rollout\.server_env\.SGLANG_RETURN_ORIGINAL_LOGPROB would make the servers .*remove it"),
    ("ppo", [SERVER, "rollout.weight_sync=tensor"], r"rollout\.weight_sync=tensor needs servers launched by RL2"),
    ("ppo", ["rollout.server_args.port=30000"], r"'rollout\.server_args\.port' is set by RL2 .*remove it"),
    ("ppo", ["rollout.server_args.api-key=x"], r"'rollout\.server_args\.api-key' is set by RL2 from rollout\.api_key"),
    ("ppo", ["critic.cp_size=0"], r"critic\.cp_size=0: a parallel degree is at least 1; set it to 1 or more"),
    ("sft", ["trainer.collective_timeout=0"],
     r"trainer\.collective_timeout=0\.0; give the seconds a collective may wait"),
    ("ppo", ["trainer.collective_timeout=1800"],
     r"trainer\.collective_timeout=1800\.0 s is shorter than rollout\.request_timeout=3600\.0 s plus 600 s"),
    ("ppo", ["rollout.weight_bucket_mb=0"], r"'rollout\.weight_bucket_mb' must be positive, got 0\.0"),
    ("eval", ["data.test.path=t.jsonl", SERVER, "rollout.engine=embedded"],
     r"rollout\.server_url is set but rollout\.engine=embedded"),
    ("eval", ["data.test.path=t.jsonl", "rollout.sampling_params.max_new_tokens=0"],
     r"rollout\.sampling_params\.max_new_tokens=0; an action needs at least 1 new token"),
    ("eval", [], r"data\.test\.path is not set"),
])
def test_a_bad_value_fails_when_the_command_line_is_parsed(trainer, argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(SCHEMAS[trainer], trainer, argv)


@pytest.mark.parametrize("trainer,argv", [
    ("sft", ["actor.avg_level=sequence"]),
    ("dpo", ["actor.beta=0.5", "actor.label_smoothing=0.1"]),
    ("ppo", [SERVER, "rollout.weight_sync=disk", "actor.dual_clip=3", "rollout.max_turns=4",
             "rollout.server_args.tp-size=2", "trainer.collective_timeout=4200"]),
    ("sft", ["trainer.collective_timeout=5"]),
    ("ppo", ["adv.estimator=mc", "adv.truncation=2"]),
    ("eval", ["data.test.path=t.jsonl", SERVER]),
    # Launched servers' keys where no server is launched (a GPU config run on the embedded engine): ignored.
    ("ppo", ["rollout.engine=embedded", "rollout.server_args.port=30000",
             "rollout.server_env.SGLANG_RETURN_ORIGINAL_LOGPROB=true"]),
])
def test_values_that_can_run_pass(trainer, argv):
    parse_config(SCHEMAS[trainer], trainer, argv)


def test_a_trainer_of_its_own_gets_the_checks_of_the_schema_it_extends():
    """A user's trainer with a schema derived from PPOConfig, under a name of its own (no YAML file)."""
    @dataclasses.dataclass
    class MyPPOConfig(PPOConfig):
        pass

    with pytest.raises(ConfigError, match=r"rollout\.max_turns=0; a trajectory takes at least 1 action"):
        parse_config(MyPPOConfig, "my_ppo", ["rollout.max_turns=0"])
