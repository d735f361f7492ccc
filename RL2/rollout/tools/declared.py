"""Tools an environment declares (Python functions, or OpenAI schema dicts its `call_tool` runs): their schemas,
running them, failures shown to the model as "Error: ..." results as a tool-calling API would, so that it can try
again, and conversations that show them. See docs/agents.md, "An environment with tools"."""

import asyncio
import inspect
import itertools
import json
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass

from transformers.utils import get_json_schema

from RL2.rollout.tools.tool_calls import ToolCall, ToolCallParser

# The tool `template_renders_tools` shows the chat template.
_PROBE_SCHEMA = {"type": "function", "function": {
    "name": "rl2_probe_tool", "description": "Probe whether the chat template renders tools.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "any text"}}}}}


@dataclass
class Tool:
    """A tool the policy may call."""

    name: str  # the name the model calls it by
    schema: dict  # OpenAI style {"type": "function", "function": {"name", "description", "parameters"}}
    fn: Callable | None  # sync or async; None for a schema-only tool run by the env's `call_tool`
    takes_extra_info: bool  # `fn` has an `extra_info` parameter (not in the schema), which RL2 fills


class ToolError(Exception):
    """Raised by a tool for a failure whose message is what the model is shown, as it is ("Error: <message>")."""


@dataclass
class ToolResult:
    """What running one call gave."""

    call: ToolCall
    content: str  # what the model is shown: the return value as text, or "Error: ..."
    error: str | None  # None on success, else "unknown_tool", "bad_arguments", "raised" or "timeout"
    seconds: float  # wall time


def build_tools(specs: list, where: str, call_tool: Callable | None = None) -> dict[str, Tool]:
    """The tools of the environment script `where` (named by the error messages), by name. `specs`: Python
    functions, `Tool`s (an MCP server's), or OpenAI schema dicts ({"type": "function", "function": {...}} or just
    the function inside), whose tools `call_tool(name, arguments, extra_info)` (sync or async) runs."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if isinstance(spec, Tool):  # built already (an MCP server's)
            tool = spec
        elif isinstance(spec, dict):
            tool = _schema_tool(spec, where, call_tool)
        elif callable(spec):
            tool = _function_tool(spec, where)
        else:
            raise ValueError(f"{where}: tool {spec!r:.80} ({type(spec).__name__}) is neither a Python function "
                             f"nor an OpenAI schema dict")
        if tool.name in tools:
            raise ValueError(f"{where}: two tools are named {tool.name!r}; rename one of them")
        tools[tool.name] = tool
    return tools


def _function_tool(fn: Callable, where: str) -> Tool:
    name = getattr(fn, "__name__", type(fn).__name__)
    if not inspect.getdoc(fn):
        raise ValueError(f"{where}: tool {name!r} has no docstring; give it one with a description of the tool "
                         f"and an Args: section with a line per parameter, which the model is shown")
    takes_extra_info = "extra_info" in inspect.signature(fn).parameters
    try:
        schema = get_json_schema(_without_extra_info(fn) if takes_extra_info else fn)
    except Exception as e:  # transformers' own exception types for docstrings and type hints it cannot read
        raise ValueError(f"{where}: cannot make the schema of tool {name!r}: {e}; give every parameter a type hint "
                         f"and a line under Args: in the docstring") from None
    return Tool(schema["function"]["name"], schema, fn, takes_extra_info)


def _without_extra_info(fn: Callable) -> Callable:
    """A stand-in for `fn` that `get_json_schema` reads as if `fn` had no `extra_info` parameter
    (it wants every parameter described, and `extra_info` is RL2's, whether or not the docstring says so)."""
    signature = inspect.signature(fn)

    def stand_in(*args, **kwargs):
        raise NotImplementedError  # never called: only read

    stand_in.__name__ = fn.__name__
    stand_in.__doc__ = fn.__doc__
    stand_in.__signature__ = signature.replace(parameters=[p for p in signature.parameters.values()
                                                           if p.name != "extra_info"])
    # Resolved against fn's module, so that string annotations (`from __future__ import annotations`) work.
    stand_in.__annotations__ = {k: v for k, v in typing.get_type_hints(fn).items() if k != "extra_info"}
    return stand_in


def _schema_tool(spec: dict, where: str, call_tool: Callable | None) -> Tool:
    function = spec["function"] if spec.get("type") == "function" and "function" in spec else spec
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: the tool schema {spec!r:.120} has no function name; write "
                         f'{{"type": "function", "function": {{"name": ..., "description": ..., "parameters": ...}}}}')
    if call_tool is None:
        raise ValueError(f"{where}: tool {name!r} is a schema without a Python function; define "
                         f"`call_tool(name, arguments, extra_info)` in {where} to run it, or list a function instead")
    function = {"parameters": {"type": "object", "properties": {}}, **function}
    return Tool(name, {"type": "function", "function": function}, None, False)


async def run_tool(tools: dict[str, Tool], call: ToolCall, extra_info: dict, timeout: float | None,
                   call_tool: Callable | None = None) -> ToolResult:
    """Run one call of `tools` (from `build_tools`) for at most `timeout` seconds (None: no limit); what goes wrong
    becomes an "Error: ..." result for the model, never an exception. `extra_info` goes to tools that take it and
    to `call_tool`. Sync functions run in the loop's default executor, so that a tool that blocks stops no other
    trajectory (a timed-out one runs on to its end: Python cannot stop a thread)."""
    start = time.perf_counter()

    def result(content: str, error: str | None = None) -> ToolResult:
        return ToolResult(call, content, error, time.perf_counter() - start)

    tool = tools.get(call.name)
    if tool is None:
        return result(f"Error: unknown tool {call.name!r}; the tools are: {', '.join(tools)}", "unknown_tool")
    if tool.fn is None:
        if call_tool is None:  # a fault of the caller, not of the model: build_tools required call_tool
            raise ValueError(f"tool {tool.name!r} is schema-only and no call_tool was given to run it")
        fn, args, kwargs = call_tool, (call.name, call.arguments, extra_info), {}
    else:
        kwargs = {**call.arguments, "extra_info": extra_info} if tool.takes_extra_info else call.arguments
        try:
            if tool.takes_extra_info and "extra_info" in call.arguments:  # RL2's to fill, not the model's
                raise TypeError("got an unexpected keyword argument 'extra_info'")
            bound = inspect.signature(tool.fn).bind(**kwargs)
        except TypeError as e:
            return result(f"Error: bad arguments for {tool.name}: {e}; its parameters are: {_parameters(tool)}",
                          "bad_arguments")
        fn, args, kwargs = tool.fn, bound.args, bound.kwargs
    try:
        value, raised = await asyncio.wait_for(_guarded(fn, args, kwargs), timeout)
    except TimeoutError:
        return result(f"Error: {tool.name} did not return within {timeout} s", "timeout")
    if raised is not None:
        shown = raised if isinstance(raised, ToolError) else f"{tool.name} raised {type(raised).__name__}: {raised}"
        return result(f"Error: {shown}", "raised")
    return result(_as_text(value))


def _parameters(tool: Tool) -> str:
    parameters = tool.schema["function"].get("parameters") or {}
    required = set(parameters.get("required", []))
    names = [f"{name}{'' if name in required else ' (optional)'}" for name in parameters.get("properties", {})]
    return ", ".join(names) or "none"


async def _guarded(fn: Callable, args: tuple, kwargs: dict) -> tuple[object, Exception | None]:
    """Call a sync or async function: (its value, None) or (None, what it raised). Returning the tool's
    exception rather than raising it keeps a TimeoutError of the tool's own apart from the timeout of `run_tool`."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs), None
        value = await asyncio.to_thread(fn, *args, **kwargs)
        if inspect.isawaitable(value):  # a sync callable that hands back a coroutine (a partial, a wrapper)
            value = await value
        return value, None
    except Exception as e:  # the user's tool code, run on arguments the model wrote
        return None, e


def _as_text(value: object) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON-serialisable (a custom object, a circular structure)
        return str(value)


def tool_result_messages(results: list[ToolResult]) -> list[dict]:
    """The role "tool" messages that show `results` to the model, in order."""
    return [{"role": "tool", "content": r.content, "tool_call_id": r.call.id, "name": r.call.name} for r in results]


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows the tools passed as `tools=` (many ignore them)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    messages = [{"role": "user", "content": "Hello"}]
    def render(tools: list[dict] | None) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    return render([_PROBE_SCHEMA]) != render(None)


def tool_system_prompt(schemas: list[dict]) -> str:
    """RL2's default tool format, Hermes style (as Qwen2.5's template writes it), for templates that
    show no tools: the schemas (one JSON line each), how to call them, and where results come back."""
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
        "The results come back within <tool_response></tool_response> XML tags."
    )


def render_conversation(tokenizer, messages: list[dict], schemas: list[dict] | None, parser: ToolCallParser,
                        native: bool, template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
    """OpenAI-style `messages` with tools (`schemas`; None or empty: none) as the text of the prompt, ending with
    the header of the assistant's next turn (not without `add_generation_prompt`: SFT renders whole
    conversations). With `native`, the template renders tools itself (`template_renders_tools`); otherwise as
    `fallback_messages`, calls in `parser`'s format. `template_kwargs`: the template's own (`enable_thinking`)."""
    rendered = [_native_message(m) for m in messages] if native else fallback_messages(messages, schemas, parser)
    tools = {"tools": schemas or None} if native else {}
    return tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **tools, **(template_kwargs or {}))


def _native_message(message: dict) -> dict:
    message = {**message, "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        # Templates write the arguments with `tojson`, so they want a dict, where the OpenAI API has a string.
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in _tool_calls(message)]
    return message


def fallback_messages(messages: list[dict], schemas: list[dict] | None, parser: ToolCallParser) -> list[dict]:
    """OpenAI-style messages with tools as plain chat messages in RL2's default format, for a template that shows
    no tools: the block of `tool_system_prompt` begins the system message, tool_calls become text in `parser`'s
    format, and each run of tool messages one user message of <tool_response> blocks, as Hermes/Qwen render them."""
    out = []
    for is_tool, run in itertools.groupby(messages, key=lambda m: m["role"] == "tool"):
        if is_tool:
            results = [f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>" for m in run]
            out.append({"role": "user", "content": "\n".join(results)})
        else:
            for message in run:  # calls written as text in `parser`'s format, after the content
                content = _text(message.get("content"))
                if message.get("tool_calls"):
                    calls = parser.format_calls(_tool_calls(message))
                    content = f"{content}\n{calls}" if content else calls
                out.append({"role": message["role"], "content": content})
    if schemas:
        block = tool_system_prompt(schemas)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{block}\n\n{out[0]['content']}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _tool_calls(message: dict) -> list[ToolCall]:
    """An assistant message's OpenAI tool_calls as `ToolCall`s (arguments decoded from JSON)."""
    calls = []
    for i, call in enumerate(message["tool_calls"]):
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            raise ValueError(f"tool call {function.get('name')!r} has arguments {arguments!r:.80}, not a JSON object")
        calls.append(ToolCall(function["name"], arguments, call.get("id") or f"call_{i}"))
    return calls


def _text(content: str | list | None) -> str:
    """A message's content as text: None is empty, and a list of OpenAI parts is the join of its text parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return content
