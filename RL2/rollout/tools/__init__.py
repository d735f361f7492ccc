"""Tools in the model's own format, for environment scripts that declare TOOLS: `tool_calls` (the formats models
write calls in, parsed and written), `declared` (an environment's tools: schemas, running them, rendering
conversations with them) and `tool_use` (a rollout's tools: an action's calls run, their results the next state)."""
