"""RL2: Ray Less Reinforcement Learning, post-training for language models under torchrun.

From Python: `RL2.train("ppo", {...}, reward=fn)` and `RL2.evaluate({...})` (see `RL2.api`).
"""

__version__ = "0.1.0"

from RL2.utils.startup_gc import off_while_a_command_imports

off_while_a_command_imports()  # before anything heavy is imported: a command starts faster (RL2/utils/startup_gc.py)

from RL2.versions import check_supported_versions  # noqa: E402

# First: a torch or transformers outside the supported range fails here with one line that names it,
# not later with an ImportError from deep inside a module written for the supported releases.
check_supported_versions()

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
