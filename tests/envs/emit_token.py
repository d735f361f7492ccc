"""Test env learnable in seconds: reward 1 when the action starts with extra_info["prefix"] (default "\\n").

A tiny random model with tied embeddings tends to repeat its last input token; after a chat
template's "assistant\\n" that is a newline, sampled some of the time, so GRPO has both rewarded and
unrewarded responses in most groups from the first step.
"""


async def step(state: str, action: str, extra_info: dict) -> dict:
    reward = float(action.startswith(extra_info.get("prefix") or "\n"))
    return {"next_state": state + action, "reward": reward, "done": True, "extra_info": extra_info}
