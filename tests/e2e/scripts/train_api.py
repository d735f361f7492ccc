"""`RL2.train` then `RL2.evaluate` with a Python reward, called by every rank under torchrun: the
overrides of both calls are JSON in argv[1] and argv[2]; each rank writes what it got to
argv[3]/rank<R>.json, with the rewards its own reward function returned."""

import json
import os
import sys
from pathlib import Path

import RL2

returned = []


def reward(response: str, extra_info: dict) -> float:
    returned.append(float(response.startswith("\n")))
    return returned[-1]


rank = os.environ["RANK"]
run = RL2.train("ppo", json.loads(sys.argv[1]), reward=reward)
evaluation = RL2.evaluate(json.loads(sys.argv[2]) | {"model.model_name": run.model_path}, reward=reward)
Path(sys.argv[3], f"rank{rank}.json").write_text(json.dumps({
    "metrics": run.metrics, "history": run.history, "model_path": str(run.model_path),
    "eval": evaluation.metrics, "returned": returned}))
