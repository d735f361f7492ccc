"""Test env: every observation is a fresh prompt, so each turn starts a new sequence."""


async def step(state: str, action: str, extra_info: dict) -> dict:
    extra_info["seen"] = extra_info.get("seen", 0) + 1
    done = extra_info["seen"] >= extra_info["turns"]
    next_state = f"Question {extra_info['seen']}: go on."
    return {"next_state": next_state, "reward": 0.5, "score": 1.0, "done": done, "extra_info": extra_info}
