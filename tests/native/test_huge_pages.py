"""A run's first hook, `RL2.native.prepare_process`, puts torch's large CPU tensors on transparent huge
pages, and importing RL2 leaves the environment alone.

Checked in fresh processes (torch reads the setting once per process, at its first CPU allocation) by
whether the kernel counts
the memory under a large tensor as eligible for huge pages (`THPeligible` in /proc/self/smaps). That
says what the process asked for, whether or not the kernel had huge pages free at that moment.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's mode ("always", "madvise" or "never"); None where there is none (not Linux)."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


no_huge_pages = pytest.mark.skipif(thp_mode() in (None, "never"), reason="no transparent huge pages in this kernel")

# What the entry points import before their run's first hook (the trainers', the evaluator's, the API's):
# none of it may allocate a CPU tensor, or torch would have read the setting before the hook sets it.
ELIGIBLE = """
import RL2.api, RL2.evaluate, RL2.trainer.ppo, RL2.trainer.sft, torch
from RL2.native import prepare_process
prepare_process(torch.device("cpu"))
tensor = torch.empty(64 * 2**20 // 4)
address, eligible, inside = tensor.data_ptr(), None, False
for line in open("/proc/self/smaps"):
    fields = line.split()
    if "-" in fields[0] and len(fields) >= 5:
        start, end = (int(part, 16) for part in fields[0].split("-"))
        inside = start <= address < end
    elif inside and fields[0] == "THPeligible:":
        eligible = int(fields[1])
print(eligible)
"""


def eligible(env_value: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", ELIGIBLE], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@no_huge_pages
def test_large_tensors_are_eligible_for_huge_pages_after_the_runs_first_hook():
    assert eligible(None) == 1


@no_huge_pages
@pytest.mark.skipif(thp_mode() == "always", reason="every anonymous mapping is eligible in 'always' mode")
def test_the_users_setting_wins():
    assert eligible("0") == 0


def test_importing_rl2_leaves_the_environment_alone():
    program = "import os; before = dict(os.environ); import RL2; print(dict(os.environ) == before)"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "True"
