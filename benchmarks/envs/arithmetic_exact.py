"""envs/arithmetic.py's task with the exact reward only: 1 for the right number in <answer></answer>, else 0."""

from RL2.rewards import last_tag


async def step(state: str, action: str, extra_info: dict) -> dict:
    written = last_tag(action, "answer")
    try:
        correct = written is not None and float(written) == float(extra_info["answer"])
    except ValueError:  # the model wrote something that is not a number
        correct = False
    return {"next_state": state + action, "reward": float(correct), "score": float(correct), "done": True,
            "extra_info": extra_info}
