"""An MCP server (the `mcp` package's MCPServer) with the calculator of envs/tool_use.py: `multiply` and `add`.
envs/mcp_tool_use.py starts it over stdio; `python envs/mcp_calculator.py --port 8000` serves it over streamable
HTTP at http://127.0.0.1:8000/mcp instead, for a script naming {"url": ...}."""

import argparse
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

server = MCPServer("calculator", log_level="WARNING")


@server.tool()
def multiply(a: Annotated[int, Field(description="the first factor.")],
             b: Annotated[int, Field(description="the second factor.")]) -> int:
    """Multiply two integers."""
    return a * b


@server.tool()
def add(a: Annotated[int, Field(description="the first term.")],
        b: Annotated[int, Field(description="the second term.")]) -> int:
    """Add two integers."""
    return a + b


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, help="serve over streamable HTTP on 127.0.0.1 (default: stdio)")
    port = parser.parse_args().port
    if port is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=port)
