"""The agent of envs/tool_use_agent.py with its calculator an MCP server (envs/mcp_calculator.py): the server's
tools come through the `tools` RL2 passes to `run` (their schemas, and calls under rollout.tool_timeout with
"Error: ..." results), `search` stays the agent's own code. `rollout.agent_path=envs/mcp_tool_use_agent.py`."""

import importlib.util
import sys
from pathlib import Path

# The agent's search and the task's scoring, from the agent script beside this one.
_spec = importlib.util.spec_from_file_location("tool_use_agent", Path(__file__).with_name("tool_use_agent.py"))
plain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plain)

MCP_SERVERS = [{"name": "calculator", "command": [sys.executable, str(Path(__file__).with_name("mcp_calculator.py"))]}]
MAX_ROUNDS = 3


async def run(client, extra_info: dict, tools) -> float:
    messages = list(extra_info["prompt"])
    for _ in range(MAX_ROUNDS):
        response = await client.chat.completions.create(model="policy", messages=messages,
                                                        tools=[plain.SEARCH, *tools.schemas], max_tokens=48)
        reply = response.choices[0].message
        if not reply.tool_calls:
            break
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            name, arguments = call.function.name, call.function.arguments
            result = (plain.call_tool(name, arguments, extra_info) if name == "search"
                      else await tools.call(name, arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return (await plain.task.step("", reply.content or "", extra_info))["reward"]
