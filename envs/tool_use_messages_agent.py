"""The agent of envs/tool_use_agent.py written against Anthropic's Messages API (`anthropic.AsyncAnthropic`),
streaming each answer. `rollout.agent_path=envs/tool_use_messages_agent.py` trains it unchanged: the endpoint serves
`/v1/messages` at the session's base URL, and takes the run's key as `x-api-key`.
"""

import importlib.util
import json
from pathlib import Path

import anthropic

# The task's tools, their chat schemas and scoring, from the chat agent beside this one.
_spec = importlib.util.spec_from_file_location("tool_use_agent", Path(__file__).with_name("tool_use_agent.py"))
chat_agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat_agent)

# Anthropic's tools: a chat schema's name and description, its parameters as `input_schema`.
TOOLS = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
         for f in (schema["function"] for schema in chat_agent.SCHEMAS)]


async def run(client, extra_info: dict) -> float:
    # Anthropic's client adds /v1/messages to its base URL: the session's, without its /v1.
    base_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key=client.api_key, max_retries=0) as claude:
        messages = list(extra_info["prompt"])
        for _ in range(chat_agent.MAX_ROUNDS):
            async with claude.messages.stream(model="policy", max_tokens=48, messages=messages, tools=TOOLS) as stream:
                reply = await stream.get_final_message()
            calls = [block for block in reply.content if block.type == "tool_use"]
            if not calls:
                break
            results = [{"type": "tool_result", "tool_use_id": call.id,
                        "content": chat_agent.call_tool(call.name, json.dumps(call.input), extra_info)}
                       for call in calls]
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": results}]
    answer = "".join(block.text for block in reply.content if block.type == "text")
    result = await chat_agent.task.step("", answer, extra_info)
    return result["reward"]
