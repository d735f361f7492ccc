"""The lent GPU machines have torch and transformers but not omegaconf, datasets, wandb, openai or aiohttp:
the CUDA test suite, the GPU benchmark and the modules they reach must import without them."""

import subprocess
import sys

from tests.helpers import REPO

MODULES = ["RL2", "RL2.workers.fsdp", "RL2.rollout.worker", "RL2.engine.embedded.engine", "RL2.models.lora",
           "tests.gpu.conftest", "tests.gpu.test_cuda_attention", "tests.gpu.test_cuda_communicators",
           "tests.gpu.test_cuda_engine",
           "tests.gpu.test_cuda_fsdp", "tests.gpu.test_cuda_ipc", "tests.gpu.test_cuda_logps",
           "tests.gpu.test_cuda_moe_push", "tests.gpu.test_cuda_precision", "benchmarks.bench_gpu",
           "benchmarks.bench_offload"]

# As if the packages a bare GPU machine lacks were not installed: `find_spec` does not find them (what
# libraries such as transformers probe) and importing them fails.
PROGRAM = f"""
import importlib, importlib.util, sys
MISSING = ("omegaconf", "datasets", "wandb", "openai", "aiohttp")
real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: (None if name.split(".")[0] in MISSING
                                                  else real_find_spec(name, *a, **k))
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Missing())
for module in {MODULES!r}:
    importlib.import_module(module)
"""


def test_the_gpu_suite_imports_without_omegaconf_datasets_wandb_openai_or_aiohttp():
    result = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
