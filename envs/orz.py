"""Open-Reasoner-Zero (arXiv 2503.24290): math problems whose reference answer is `extra_info["answer"]`.
The response's final answer (its last \\boxed{...}, else its last expression, as math-verify extracts it)
is compared with the reference symbolically. Reward and score 1 if equivalent, else 0, as the original
RL2's envs/orz.py. Needs math-verify: pip install math-verify (or 'RL2[math]')."""

from RL2.rewards import math_reward, require_math_verify, reward_step


async def step(state: str, action: str, extra_info: dict) -> dict:
    require_math_verify()
    return reward_step(math_reward(action, extra_info, pattern=None), extra_info)
