"""Test env speaking chat messages: the rollout renders them with the chat template."""


async def reset(extra_info: dict) -> list[dict]:
    extra_info["messages"] = [{"role": "user", "content": extra_info["question"]}]
    return extra_info["messages"]


async def step(state: str, action: str, extra_info: dict) -> dict:
    extra_info["messages"] += [{"role": "assistant", "content": action}, {"role": "user", "content": "Go on."}]
    done = len(extra_info["messages"]) > 2 * extra_info["turns"]
    return {"next_state": extra_info["messages"], "reward": 1.0, "done": done, "extra_info": extra_info}
