"""The long-tail workload of benchmarks/bench_async.py: arithmetic questions asked one after another in one
conversation, one answer each in <answer></answer> tags. `extra_info["questions"]` and `["answers"]` hold a
prompt's questions: most prompts ask one, a few ask many, so a few trajectories are many times longer than
the rest, the tail that holds up a synchronous step. A right answer scores 1 / (number of questions), a wrong
number in the tags a tenth of that (as envs/arithmetic.py), so every trajectory's score is in [0, 1].
"""

import math

from RL2.rewards import last_tag

FORMAT_REWARD = 0.1


def as_number(written: str | None) -> float | None:
    try:
        number = float(written)
    except (TypeError, ValueError):  # no answer, or the model wrote something that is not a number
        return None
    return number if math.isfinite(number) else None


async def step(state: str, action: str, extra_info: dict) -> dict:
    asked, answers = extra_info.get("asked", 0), extra_info["answers"]
    number = as_number(last_tag(action, "answer"))
    correct = number is not None and number == float(answers[asked])
    share = 1.0 / len(answers)
    reward = share * (1.0 if correct else FORMAT_REWARD if number is not None else 0.0)
    asked += 1
    done = asked == len(answers)
    # The next question continues the conversation: the chat template renders it after the answer.
    messages = extra_info["messages"] + [{"role": "assistant", "content": action}]
    if not done:
        messages.append({"role": "user", "content": extra_info["questions"][asked]})
    info = extra_info | {"asked": asked, "messages": messages}
    return {"next_state": messages, "reward": reward, "score": share * correct, "done": done, "extra_info": info}
