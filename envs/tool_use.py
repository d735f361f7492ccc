"""An agent with tools in the model's own format: a calculator for products the model cannot work out
in its head, and a search over a local corpus for facts it cannot know (examples/data/make_tool_use.py).

The policy calls `multiply`, `add` or `search` as its chat template says (RL2's default Hermes-style
`<tool_call>` JSON for templates that know no tools), reads the results, and answers. Only the answer
(an action that calls no tool) is scored: 1 when it holds `extra_info["answer"]` (for a number, the last
number it writes), else 0.
"""

import re

from RL2.rewards.retrieval import bm25_index

NUMBER = re.compile(r"-?\d+")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term.
        b: the second term.
    """
    return a + b


def search(query: str, extra_info: dict) -> str:
    """Search the encyclopedia for passages about a topic.

    Args:
        query: what to look for, e.g. "capital of Norway".
    """
    return "\n".join(bm25_index(extra_info["corpus"]).top(query, k=2))


TOOLS = [multiply, add, search]


async def step(state: str, action: str, extra_info: dict) -> dict:
    answer = str(extra_info["answer"])
    if NUMBER.fullmatch(answer):
        written = NUMBER.findall(action.replace(",", ""))
        correct = bool(written) and written[-1] == answer
    else:
        correct = answer.lower() in action.lower()
    return {"reward": float(correct), "done": True}
