"""Tools in the model's own format, for scripts that declare TOOLS or MCP_SERVERS (docs/agents.md): `tool_calls`,
`declared`, `mcp_servers` and `tool_use`, each module's docstring saying its part."""
