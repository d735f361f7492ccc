"""keep_freed_memory: tensors allocated again after a free reuse their pages instead of faulting.

Measured in fresh processes (the setting is process-wide), by the kernel's minor page fault count
per sampling step. Where glibc's defaults put a block (heap or mmap, trimmed or not) depends on
what else the process allocated, so with them the count varies from run to run: measured over 20
fresh processes, 99-100 of 100 steps faulted on a block of fresh pages in most, 20-26 in others.
With the blocks kept, 0-2 of 100 did (a rare step still lands on new heap).
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and getrusage faults")

SAMPLE = """
import resource, torch
from RL2.engine.embedded.sampling import SamplingParams, sample_next_tokens
from RL2.engine.embedded.allocator import keep_freed_memory
print(keep_freed_memory())
logits = torch.randn(32, 49152, dtype=torch.bfloat16)  # a decode step's logits
params = [SamplingParams(temperature=1.0)] * 32
def sample():
    sample_next_tokens(logits, params, [[]] * 32, [None] * 32)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    sample()
faulting_steps = 0
for _ in range(STEPS):
    before = faults()
    sample()
    faulting_steps += faults() - before > PAGES_PER_BLOCK // 2
print(faulting_steps)
"""
STEPS = 100
PAGES_PER_BLOCK = 32 * 49152 * 4 // 4096  # one float32 [32, vocab] tensor


def count_faulting_steps(keep: str) -> tuple[str, int]:
    """(whether keep_freed_memory applied, how many of STEPS sampling steps faulted on half a block or more)."""
    env = os.environ | {"RL2_KEEP_FREED_MEMORY": keep}
    script = f"STEPS, PAGES_PER_BLOCK = {STEPS}, {PAGES_PER_BLOCK}\n{SAMPLE}"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    applied, faulted = out.stdout.split()
    return applied, int(faulted)


def test_sampling_reuses_freed_blocks_without_page_faults():
    applied, faulted = count_faulting_steps("1")
    assert applied == "True"
    assert faulted <= STEPS // 20, f"{faulted} of {STEPS} steps faulted on fresh pages"
    applied, faulted = count_faulting_steps("0")  # glibc's defaults: steps fault again and again
    assert applied == "False"
    assert faulted >= STEPS // 10, f"only {faulted} of {STEPS} steps faulted: the measurement sees no churn"
