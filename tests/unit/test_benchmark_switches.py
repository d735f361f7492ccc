"""The RL2 switches benchmarks/bench_ppo_w1.py compares are keys the PPO trainer accepts, with values it
takes: a renamed or mistyped key fails here, not after a benchmark has run for minutes."""

import functools
import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from RL2.config import parse_config
from RL2.config.ppo_schema import PPOConfig

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ppo_w1.py"


@functools.cache
def variants() -> dict:
    spec = importlib.util.spec_from_file_location("bench_ppo_w1", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.VARIANTS


@pytest.mark.parametrize("name", sorted(variants()))
def test_every_w1_variant_parses(name):
    overrides, _ = variants()[name]
    cfg = parse_config(PPOConfig, "ppo", list(overrides))
    for override in overrides:
        key, value = override.split("=", 1)
        assert str(OmegaConf.select(cfg, key)).lower() == value.lower()
