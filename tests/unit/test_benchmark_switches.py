"""The RL2 switches benchmarks/bench_ppo_w1.py compares are keys the PPO trainer accepts, with values it
takes: a renamed or mistyped key fails here, not after a benchmark has run for minutes; and the
environment of `--isa avx2` does what it says."""

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from RL2.config import parse_config
from RL2.config.ppo_schema import PPOConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@functools.cache
def benchmark_module(name: str):
    """A module of benchmarks/ (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants() -> dict:
    return benchmark_module("bench_ppo_w1").VARIANTS


@pytest.mark.parametrize("name", sorted(variants()))
def test_every_w1_variant_parses(name):
    overrides, _ = variants()[name]
    cfg = parse_config(PPOConfig, "ppo", list(overrides))
    for override in overrides:
        key, value = override.split("=", 1)
        assert str(OmegaConf.select(cfg, key)).lower() == value.lower()


@pytest.mark.skipif(not torch.cpu._is_avx512_supported(),
                    reason="needs an AVX512 CPU, where torch's own choice is not AVX2")
def test_the_avx2_environment_keeps_torch_to_avx2_and_rl2_to_float32():
    """`--isa avx2` (benchmarks/common.py): in a process started with it, torch's kernels are its AVX2 ones,
    oneDNN has no bf16 matmul, and so `dtype=auto` is float32, as on an AVX2 CPU."""
    common = benchmark_module("common")
    ask = [sys.executable, "-c", "import torch; from RL2.models.precision import compute_dtype; "
           "print(torch.backends.cpu.get_cpu_capability(), torch.ops.mkldnn._is_mkldnn_bf16_supported(), "
           "compute_dtype('auto', torch.device('cpu')))"]
    avx2 = subprocess.run(ask, capture_output=True, text=True, check=True,
                          env=os.environ | common.ISA_ENVIRONMENTS["avx2"]).stdout.split()
    assert avx2 == ["AVX2", "False", "torch.float32"]
    native = subprocess.run(ask, capture_output=True, text=True, check=True).stdout.split()
    assert native[0].startswith("AVX512"), native
