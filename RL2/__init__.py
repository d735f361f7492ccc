"""RL2: Ray Less Reinforcement Learning, post-training for language models under torchrun.

From Python: `RL2.train("ppo", {...}, reward=fn)` and `RL2.evaluate({...})` (see `RL2.api`).
"""

import os

# Large CPU tensors on transparent huge pages: torch reads this once, at its first CPU allocation, so
# it is set here, before any RL2 module imports torch. A step's fresh blocks (logits, their gradient,
# activations) then fault 2 MB at a time instead of 4 KB. Linux only; a value the user set wins
# (0 turns it off).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
from RL2.config.errors import ConfigError  # noqa: E402

__all__ = ["ConfigError", "EvalResult", "TrainResult", "evaluate", "parse_config", "train"]


def __getattr__(name: str):
    # The API imports the trainers, and the command line omegaconf: only when used, so that `import RL2`
    # stays light and the models and engines import where omegaconf is not installed.
    if name in ("train", "evaluate", "TrainResult", "EvalResult"):
        from RL2 import api

        return getattr(api, name)
    if name == "parse_config":
        from RL2.config.cli import parse_config

        return parse_config
    raise AttributeError(f"module 'RL2' has no attribute {name!r}")
