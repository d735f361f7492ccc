"""Test MCP server (the `mcp` package's MCPServer): `python mcp_server.py` serves over stdio,
`python mcp_server.py PORT` over streamable HTTP on 127.0.0.1:PORT (path /mcp)."""

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("rl2-test-tools", log_level="ERROR")
CAPITALS = {"Norway": "Oslo", "Peru": "Lima"}


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@server.tool()
def capital(country: str) -> str:
    """The capital of a country."""
    if country not in CAPITALS:
        raise ToolError(f"no country named {country}")
    return CAPITALS[country]


@server.tool()
async def wait(seconds: float) -> str:
    """Wait, then say so."""
    await asyncio.sleep(seconds)
    return "waited"


@server.tool()
def crash() -> str:
    """End the server's process at once, as a crashing server does."""
    os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run()
