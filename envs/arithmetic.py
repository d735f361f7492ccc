"""Arithmetic questions (examples/data/make_arithmetic.py): the last <answer>N</answer> of the
action is compared with `extra_info["answer"]`. Reward 1 if equal, 0.1 for a wrong number in the
tags (the format is learnt first), 0 otherwise. The score counts correct answers only.

The format reward needs a number in the tags: an empty `<answer></answer>`, which the instruction
itself spells out, would otherwise be an easy 0.1 that the policy learns to copy."""

import math

from RL2.rewards import last_tag

FORMAT_REWARD = 0.1


def as_number(written: str | None) -> float | None:
    try:
        number = float(written)
    except (TypeError, ValueError):  # no answer, or the model wrote something that is not a number
        return None
    return number if math.isfinite(number) else None  # "nan" and "inf" parse, but are no answers


async def step(state: str, action: str, extra_info: dict) -> dict:
    number = as_number(last_tag(action, "answer"))
    correct = number is not None and number == float(extra_info["answer"])
    reward = 1.0 if correct else FORMAT_REWARD if number is not None else 0.0
    return {"next_state": state + action, "reward": reward, "score": float(correct), "done": True,
            "extra_info": extra_info}
