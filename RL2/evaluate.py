"""Evaluate a model on test prompts: `python -m RL2.evaluate model.model_name=... data.test.path=...
rollout.reward_fn=...` (docs/evaluation.md; every key: `--help`). The evaluator itself is `RL2/evaluation/`."""

import sys
import types

from RL2.config.cli import ConfigError, parse_config
from RL2.config.eval_schema import EvalConfig
from RL2.datasets.loading import DataError
from RL2.evaluation.evaluator import Evaluator
from RL2.parallel import close_process_groups
from RL2.rollout.env import EnvError
from RL2.utils.startup_gc import command_ends, imports_done


def main(argv: list[str] | None = None) -> None:
    """Entry point: config, data and environment errors end with a message, not a traceback."""
    imports_done()
    finished = False
    try:
        Evaluator(parse_config(EvalConfig, "eval", argv)).run()
        finished = True
    except (ConfigError, DataError, EnvError) as e:
        sys.exit(f"RL2 evaluate: {e}")
    finally:
        close_process_groups(finished)
        command_ends()


class _CallableModule(types.ModuleType):
    """`RL2.evaluate` is also the Python API's function, and importing this module makes the name
    `RL2.evaluate` this module: calling it calls the function, so the import takes nothing away."""

    def __call__(self, *args, **kwargs):
        from RL2.api import evaluate

        return evaluate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
