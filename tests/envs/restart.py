"""Test env: every observation is a fresh prompt, so each turn starts a new sequence. A turn's reward
depends on the action (1 when its text has an odd number of characters, else 0), so the trajectories
of one prompt differ."""


async def step(state: str, action: str, extra_info: dict) -> dict:
    extra_info["seen"] = extra_info.get("seen", 0) + 1
    done = extra_info["seen"] >= extra_info["turns"]
    next_state = f"Question {extra_info['seen']}: go on."
    reward = float(len(action) % 2)
    return {"next_state": next_state, "reward": reward, "score": 1.0, "done": done, "extra_info": extra_info}
