"""What the tests share: tiny models (`tiny`), runs in fresh processes (`launch`), and the folders of
the test environments, reward functions and scripts."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
ENVS = TESTS / "envs"  # environment scripts of the tests
REWARDS = TESTS / "rewards"  # reward functions of the tests
SCRIPTS = TESTS / "e2e" / "scripts"  # programs the end-to-end tests run, under torchrun or not
SGLANG_STUB = TESTS / "sglang_stub"  # put on the SGLang servers' path on CPU (see e2e/test_sglang.py)
