"""The tests that need a real SGLang: RL2_SGLANG_PYTHON names a Python with sglang installed (its own virtual
environment, or RL2's when both share one). `.ci/run` runs them once, in its step for SGLang's environment."""

import os

import pytest

SGLANG_PYTHON = os.environ.get("RL2_SGLANG_PYTHON")
SKIP_REASON = os.environ.get("RL2_SGLANG_SKIP_REASON") or (
    "RL2_SGLANG_PYTHON is not set: point it at the python of a virtual environment with sglang installed "
    "(.ci/run builds ~/.cache/rl2/sglang-venv)")


def needs_sglang(test):
    """Mark `test` as one of SGLang's (`pytest -m sglang` selects them) and skip it, saying why, without SGLang."""
    return pytest.mark.sglang(pytest.mark.skipif(not SGLANG_PYTHON, reason=SKIP_REASON)(test))
