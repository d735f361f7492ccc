"""A weighted sum of rewards, each part kept so that it is logged as its own metric, and the `step`
result that ends a trajectory with a reward."""

import inspect
from collections.abc import Awaitable, Callable

RewardFn = Callable[[str, dict], "float | dict | Awaitable[float | dict]"]


def composite(parts: dict[str, tuple[float, RewardFn]],
              score: str | None = None) -> Callable[[str, dict], Awaitable[dict]]:
    """A reward function returning `{"reward": sum of weight * part, "score": ..., name: part, ...}`.
    `parts`: name -> (weight, reward function), each any reward function (sync or async, `(response, extra_info)`);
    one that returns a dict contributes its "reward", and its other entries are kept as `name/entry`. The parts
    appear in metrics.jsonl as `rollout/reward/<name>` (unweighted means). `score`: the part reported as the
    score (e.g. correctness without format credit); default: the reward."""
    for name in parts:
        if name in ("reward", "score"):
            raise ValueError(f"a part cannot be called '{name}': that key holds the total")
    if score is not None and score not in parts:
        raise ValueError(f"score='{score}' is not one of the parts {sorted(parts)}")

    async def reward(response: str, extra_info: dict) -> dict:
        values, total = {}, 0.0
        for name, (weight, function) in parts.items():
            value = await call_reward(function, response, extra_info)
            if isinstance(value, dict):
                values |= {f"{name}/{key}": v for key, v in value.items() if key not in ("reward", "score")}
                value = value["reward"]
            values[name] = float(value)
            total += weight * values[name]
        return {"reward": total, "score": values[score] if score else total} | values

    return reward


async def call_reward(function: RewardFn, response: str, extra_info: dict) -> float | dict:
    """Call a sync or async reward function."""
    result = function(response, extra_info)
    return await result if inspect.isawaitable(result) else result


def reward_step(result: float | dict, extra_info: dict) -> dict:
    """The `step` result that ends a trajectory with a reward function's `result`: a number, or a dict with
    "reward", optionally "score", and parts (name -> number); `extra_info` (what the step got) goes back as it is."""
    if isinstance(result, dict):
        if "reward" not in result:
            raise ValueError(f"a reward dict needs a 'reward' entry (the trained total); it has {sorted(result)}")
        parts = {name: value for name, value in result.items() if name not in ("reward", "score")}
        reward, score = result["reward"], result.get("score", result["reward"])
    else:
        reward, score, parts = result, result, {}
    return {"next_state": None, "reward": reward, "score": score, "done": True, "extra_info": extra_info,
            "reward_parts": parts}
