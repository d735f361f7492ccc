"""Test env with tools: `count_chars` (sync, reads extra_info), `slow` (async, sleeps) and `broken` (raises).
An answer (an action that calls no tool) scores 1 and ends the trajectory."""

import asyncio


def count_chars(text: str, extra_info: dict) -> int:
    """Count the characters of a text.

    Args:
        text: the text to count.
    """
    return len(text) + extra_info.get("offset", 0)


async def slow(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: how long to wait.
    """
    await asyncio.sleep(seconds)
    return "waited"


def broken() -> str:
    """A tool that always fails."""
    raise RuntimeError("broken tool")


TOOLS = [count_chars, slow, broken]


async def step(state: str, action: str, extra_info: dict) -> dict:
    return {"reward": 1.0, "done": True}
