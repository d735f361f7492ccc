"""RL2: Ray Less Reinforcement Learning, post-training for language models under torchrun.

From Python: `RL2.train("ppo", {...}, reward=fn)` and `RL2.evaluate({...})` (see `RL2.api`).
"""

__version__ = "0.1.0"
from RL2.config.cli import ConfigError, parse_config

__all__ = ["ConfigError", "EvalResult", "TrainResult", "evaluate", "parse_config", "train"]


def __getattr__(name: str):
    # The API imports torch and the trainers: only when it is used, so that `import RL2` stays light.
    if name in ("train", "evaluate", "TrainResult", "EvalResult"):
        from RL2 import api

        return getattr(api, name)
    raise AttributeError(f"module 'RL2' has no attribute {name!r}")
