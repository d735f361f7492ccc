"""Tools in the model's own format, for scripts that declare TOOLS or MCP_SERVERS: `tool_calls` (the formats models
write calls in, parsed and written), `declared` (an environment's tools: schemas, running them, rendering
conversations with them), `mcp_servers` (the tools of MCP servers, as `declared` tools) and `tool_use` (a rollout's
tools: an action's calls run, their results the next state; an agent's `ToolBox`)."""
