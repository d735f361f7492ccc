"""Evaluate a model on test prompts: `python -m RL2.evaluate model.model_name=... data.test.path=...
rollout.reward_fn=...` (docs/evaluation.md; every key: `--help`). The evaluator itself is `RL2/evaluation/`."""

import sys
import types

from RL2.config.eval_schema import EvalConfig
from RL2.evaluation.evaluator import Evaluator
from RL2.trainer.base import run_command


def main(argv: list[str] | None = None) -> None:
    """Entry point: config, data and environment errors end with a message, not a traceback."""
    run_command("RL2 evaluate", EvalConfig, "eval", lambda cfg: Evaluator(cfg).run(), argv)


class _CallableModule(types.ModuleType):
    """`RL2.evaluate` is also the Python API's function, and importing this module makes the name
    `RL2.evaluate` this module: calling it calls the function, so the import takes nothing away."""

    def __call__(self, *args, **kwargs):
        from RL2.api import evaluate

        return evaluate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
