"""A plain reward function learnable in seconds (emit_token.py's task, for `rollout.reward_fn`):
1 for a response starting with a newline, plus a small part for short responses, each logged."""

from RL2.rewards import composite


def starts_with_newline(response: str, extra_info: dict) -> float:
    return float(response.startswith("\n"))


def short(response: str, extra_info: dict) -> float:
    return float(len(response) <= 8)


reward = composite({"newline": (1.0, starts_with_newline), "short": (0.1, short)}, score="newline")
