"""Test env learnable in seconds: reward 1 when the action starts with extra_info["prefix"] (default "\\n").

A tiny random model with tied embeddings tends to repeat its last input token; after a chat
template's "assistant\\n" that is a newline, sampled some of the time, so GRPO has both rewarded and
unrewarded responses in most groups from the first step.

Its steps queue for a semaphore made at import, as scripts do with a client session or a rate
limit: that works only if every rollout of the run (every step, evaluation, compared model) runs on
one event loop; on a new loop per rollout the second one would fail ("bound to a different event loop").
"""

import asyncio

ONE_AT_A_TIME = asyncio.Semaphore(1)


async def step(state: str, action: str, extra_info: dict) -> dict:
    async with ONE_AT_A_TIME:
        await asyncio.sleep(0.01)  # held across a suspension, so that concurrent steps really wait for it
        reward = float(action.startswith(extra_info.get("prefix") or "\n"))
    return {"next_state": state + action, "reward": reward, "done": True, "extra_info": extra_info}
