"""The agent of envs/tool_use_agent.py written against OpenAI's Responses API (`client.responses`): the server keeps
the conversation, each call sends only what is new (the tools' results) with `previous_response_id`.
`rollout.agent_path=envs/tool_use_responses_agent.py` trains it unchanged.
"""

import importlib.util
from pathlib import Path

# The task's tools, their chat schemas and scoring, from the chat agent beside this one.
_spec = importlib.util.spec_from_file_location("tool_use_agent", Path(__file__).with_name("tool_use_agent.py"))
chat_agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat_agent)

# The Responses API's function tools: a chat schema's "function", flat.
TOOLS = [{"type": "function", **schema["function"]} for schema in chat_agent.SCHEMAS]


async def run(client, extra_info: dict) -> float:
    response = await client.responses.create(model="policy", input=extra_info["prompt"], tools=TOOLS,
                                             max_output_tokens=48)
    for _ in range(chat_agent.MAX_ROUNDS - 1):
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            break
        results = [{"type": "function_call_output", "call_id": call.call_id,
                    "output": chat_agent.call_tool(call.name, call.arguments, extra_info)} for call in calls]
        response = await client.responses.create(model="policy", input=results, previous_response_id=response.id,
                                                 tools=TOOLS, max_output_tokens=48)
    result = await chat_agent.task.step("", response.output_text, extra_info)
    return result["reward"]
