"""Tools in the model's own format, for scripts that declare TOOLS or MCP_SERVERS (docs/agents.md)."""
