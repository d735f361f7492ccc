"""Math answers checked with Hugging Face's `math-verify` against `extra_info["answer"]`: it
extracts the final answer (\\boxed{...} or the last expression) and compares it symbolically.
Reward and score 1 if equivalent, else 0. Needs `pip install math-verify` (or 'RL2[math]')."""


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("envs/math_verify.py needs the math-verify package: pip install math-verify") from e
    return math_verify


async def step(state: str, action: str, extra_info: dict) -> dict:
    math_verify = _math_verify()
    gold = math_verify.parse(f"${extra_info['answer']}$")
    # math-verify returns no match (not an error) for unparsable answers; it bounds its own time.
    correct = math_verify.verify(gold, math_verify.parse(action))
    reward = float(correct)
    return {"next_state": state + action, "reward": reward, "score": reward, "done": True, "extra_info": extra_info}
