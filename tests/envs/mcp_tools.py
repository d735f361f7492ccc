"""Test env with the tools of an MCP server (tests/envs/mcp_server.py, over stdio) next to a plain one.
An answer (an action that calls no tool) scores 1 and ends the trajectory."""

import sys
from pathlib import Path


def count_chars(text: str) -> int:
    """Count the characters of a text.

    Args:
        text: the text to count.
    """
    return len(text)


TOOLS = [count_chars]
MCP_SERVERS = [{"name": "test-tools", "command": [sys.executable, str(Path(__file__).with_name("mcp_server.py"))]}]


async def step(state: str, action: str, extra_info: dict) -> dict:
    return {"reward": 1.0, "done": True}
