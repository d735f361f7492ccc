"""Tools in the model's own format, for environment scripts that declare TOOLS.

- `tool_calls`: the tool-call formats models write (Hermes/Qwen, Llama 3, Mistral), parsed and written.
- `declared`: the tools an environment declares: their schemas, running them, rendering conversations with them.
- `tool_use`: a rollout's tools: an action's calls run and their results made the next state.
"""
