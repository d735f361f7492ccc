"""Test agent script naming the MCP server of tests/envs/mcp_server.py (stdio): one model call shown the server's
tools, then calls of them through `tools`; reward 1 when multiply gives 42."""

import sys
from pathlib import Path

MCP_SERVERS = [{"command": [sys.executable, str(Path(__file__).with_name("mcp_server.py"))]}]


async def run(client, extra_info: dict, tools) -> dict:
    await client.chat.completions.create(model="policy", messages=extra_info["prompt"], tools=tools.schemas,
                                         max_tokens=4)
    product = await tools.call("multiply", '{"a": 6, "b": 7}')
    missing = await tools.call("capital", {"country": "Atlantis"})
    return {"reward": float(product == "42"), "metrics": {"saw_error": float(missing.startswith("Error: "))}}
