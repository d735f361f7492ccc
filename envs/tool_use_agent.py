"""The task of envs/tool_use.py written as an agent against the `openai` client, as agents are written
outside RL2: `rollout.agent_path=envs/tool_use_agent.py` trains it unchanged (RL2 serves the client an
OpenAI-compatible endpoint over the rollout engine and records the tokens of every call).

The agent sends the question with the tools' schemas, runs the calls the model makes, sends the results
back, and scores the model's answer with the environment's own check.
"""

import importlib.util
import json
from pathlib import Path

from transformers.utils import get_json_schema

# The task's tools and scoring, from the environment script beside this one.
_spec = importlib.util.spec_from_file_location("tool_use_task", Path(__file__).with_name("tool_use.py"))
task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(task)

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the encyclopedia for passages about a topic.",
    "parameters": {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string", "description": 'what to look for, e.g. "capital of Norway".'}}}}}
SCHEMAS = [get_json_schema(task.multiply), get_json_schema(task.add), SEARCH]
MAX_ROUNDS = 3


def call_tool(name: str, arguments: str, extra_info: dict) -> str:
    """A call's result as text; a call the model got wrong gets an error it can read."""
    try:
        kwargs = json.loads(arguments)
        if name == "search":
            return task.search(**kwargs, extra_info=extra_info)
        return str({"multiply": task.multiply, "add": task.add}[name](**kwargs))
    except (KeyError, TypeError, ValueError) as e:  # model-written: unknown tool, bad JSON or arguments
        return f"Error: {type(e).__name__}: {e}"


async def run(client, extra_info: dict) -> float:
    messages = list(extra_info["prompt"])
    for _ in range(MAX_ROUNDS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=SCHEMAS,
                                                        max_tokens=48)
        reply = response.choices[0].message
        if not reply.tool_calls:
            break
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            result = call_tool(call.function.name, call.function.arguments, extra_info)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    result = await task.step("", reply.content or "", extra_info)
    return result["reward"]
