"""`RL2.evaluate` with a Python reward function, called by every rank under torchrun (or by a plain
process): the overrides are JSON in argv[1]; each rank writes the result it got to argv[2]/rank<R>.json."""

import asyncio
import json
import os
import sys
from pathlib import Path

import RL2


async def reward(response: str, extra_info: dict) -> float:
    """tests/envs/emit_token.py's reward, as an async function (as a remote verifier would be)."""
    await asyncio.sleep(0)
    return float(response.startswith(extra_info.get("prefix") or "\n"))


rank = os.environ.get("RANK", "0")
result = RL2.evaluate(json.loads(sys.argv[1]), reward=reward)
got = {"metrics": result.metrics, "compare": result.compare, "difference": result.difference,
       "save_dir": str(result.save_dir)}
Path(sys.argv[2], f"rank{rank}.json").write_text(json.dumps(got))
