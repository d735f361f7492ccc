"""Test env: every observation continues the text, so all turns share one sequence.

Reward 1 per action; done after extra_info["turns"] actions (never without it).
"""


async def step(state: str, action: str, extra_info: dict) -> dict:
    extra_info["seen"] = extra_info.get("seen", 0) + 1
    done = extra_info["seen"] >= extra_info.get("turns", float("inf"))
    next_state = state + action + f"\nobservation {extra_info['seen']}\n"
    return {"next_state": next_state, "reward": 1.0, "done": done, "extra_info": extra_info}
