"""Math answers checked with Hugging Face's `math-verify` against `extra_info["answer"]`: it
extracts the final answer (\\boxed{...} or the last expression) and compares it symbolically.
Reward and score 1 if equivalent, else 0. Needs `pip install math-verify` (or 'RL2[math]').

`rollout.reward_fn=RL2.rewards:math_reward` does the same on the last \\boxed{...} only, and
works without math-verify too."""

from RL2.rewards import math_reward, require_math_verify, reward_step


async def step(state: str, action: str, extra_info: dict) -> dict:
    require_math_verify()
    return reward_step(math_reward(action, extra_info, pattern=None), extra_info)
