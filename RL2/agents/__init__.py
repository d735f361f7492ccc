"""Agents: policies that call tools over several turns.

- `tool_calls`: the tool-call formats models write (Hermes/Qwen, Llama 3, Mistral), parsed and written.
- `tools`: the tools an environment declares: their schemas, running them, rendering conversations with them.
- `openai_server`: an OpenAI-compatible HTTP endpoint over a rank's engine that records the tokens.
- `agent`: agent scripts (`async def run(client, extra_info)`) rolled out as trajectories.
"""
