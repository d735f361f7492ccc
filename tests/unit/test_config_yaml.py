"""A trainer's YAML file holds only what differs from its schema's defaults, so that each default is
written once, in the dataclass that `--help` reads."""

import pytest
from omegaconf import OmegaConf

from RL2.api import SCHEMAS
from RL2.config.cli import CONFIG_DIR, parse_config
from RL2.config.schema import SFTConfig

YAMLS = sorted(CONFIG_DIR.glob("*.yaml"))


def leaves(tree: dict, prefix: str = "") -> dict:
    """{dotted key: value} of every leaf of a nested dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= leaves(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_a_trainer_yaml_restates_no_schema_default(path):
    assert path.stem in SCHEMAS, f"{path.name} belongs to no trainer; the trainers are {sorted(SCHEMAS)}"
    written = leaves(OmegaConf.to_container(OmegaConf.load(path), resolve=False))
    defaults = leaves(OmegaConf.to_container(OmegaConf.structured(SCHEMAS[path.stem]), resolve=False))
    restated = {key: value for key, value in written.items() if defaults.get(key, object()) == value}
    assert not restated, f"{path.name} restates the schema's defaults {restated}; remove them from the YAML"


def test_the_yaml_values_reach_the_parsed_config():
    cfg = parse_config(SCHEMAS["dpo"], "dpo", [])
    assert (cfg.data.train.batch_size, cfg.actor.optimizer.lr, cfg.trainer.save_dir) == (16, 5e-7, "ckpts/dpo")
    ppo = parse_config(SCHEMAS["ppo"], "ppo", ["actor.dtype=float32"])
    assert ppo.critic.dtype == "float32"  # the critic follows the actor's dtype


def test_a_trainer_without_a_yaml_parses_to_the_schema_defaults(monkeypatch, tmp_path):
    monkeypatch.setattr("RL2.config.cli.CONFIG_DIR", tmp_path)  # no YAML file at all
    cfg = parse_config(SFTConfig, "no_yaml", ["trainer.seed=7"])
    expected = SFTConfig()
    expected.trainer.seed = 7
    expected.trainer.save_dir = "ckpts/run"  # ${trainer.experiment_name}, resolved
    assert OmegaConf.to_container(cfg) == OmegaConf.to_container(OmegaConf.structured(expected))
