"""Arithmetic questions (examples/data/make_arithmetic.py): the last <answer>N</answer> of the
action is compared with `extra_info["answer"]`. Reward 1 if equal, 0.1 for a wrong answer in the
tag (the format is learnt first), 0 without the tag. The score counts correct answers only."""

import re

FORMAT_REWARD = 0.1


def same_number(written: str, answer: str) -> bool:
    try:
        return float(written.strip()) == float(answer)
    except ValueError:  # the model wrote something that is not a number
        return False


async def step(state: str, action: str, extra_info: dict) -> dict:
    answers = re.findall(r"<answer>(.*?)</answer>", action, re.DOTALL)
    correct = bool(answers) and same_number(answers[-1], str(extra_info["answer"]))
    reward = 1.0 if correct else FORMAT_REWARD if answers else 0.0
    score = float(correct)
    return {"next_state": state + action, "reward": reward, "score": score, "done": True, "extra_info": extra_info}
