"""Tools: schemas from functions, running calls (errors, timeouts, threads), and rendering conversations."""

import asyncio
import copy
import threading
import time
from pathlib import Path

import pytest

from RL2.rollout.tools.declared import (
    Tool,
    ToolResult,
    build_tools,
    render_conversation,
    run_tool,
    template_renders_tools,
    tool_result_messages,
    tool_system_prompt,
)
from RL2.rollout.tools.tool_calls import HermesParser, ToolCall

# ---- tools of a test environment ----


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


async def lookup(key: str, extra_info: dict, default: str = "none") -> str:
    """Look a key up in the row's table.

    Args:
        key: the key.
        extra_info: the row's extra_info, filled by RL2.
        default: the answer when the key is missing.
    """
    return extra_info["table"].get(key, default)


def secret(extra_info) -> str:
    """Tell the row's secret."""
    return extra_info["secret"]


def quoted(n: "int", extra_info: "dict") -> "str":
    """Repeat the row's word.

    Args:
        n: how many times.
    """
    return extra_info["word"] * n


def weather(city: str) -> dict:
    """The weather of a city.

    Args:
        city: its name.
    """
    return {"city": city, "temps": [1.5, 2]}


def boom(x: int) -> None:
    """Fail.

    Args:
        x: anything.
    """
    raise ValueError(f"x={x} must be positive")


def own_timeout() -> str:
    """Time out inside the tool."""
    raise TimeoutError("the upstream service timed out")


def nothing() -> None:
    """Return nothing."""


class Opaque:
    def __str__(self):
        return "<opaque thing>"


def opaque() -> Opaque:
    """Return an object JSON cannot write."""
    return Opaque()


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments, "call_0")


def run(tools, tool_call, extra_info=None, timeout=5.0, call_tool=None) -> ToolResult:
    return asyncio.run(run_tool(tools, tool_call, extra_info or {}, timeout, call_tool))


# ---- build_tools ----


def test_schemas_of_functions_leave_out_extra_info():
    tools = build_tools([add, lookup, secret, quoted], "envs/table.py")
    assert list(tools) == ["add", "lookup", "secret", "quoted"]
    assert tools["add"] == Tool("add", {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first number."},
                    "b": {"type": "integer", "description": "the second number."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }, add, False)
    # extra_info described in the docstring
    assert tools["lookup"].takes_extra_info and tools["lookup"].fn is lookup
    assert tools["lookup"].schema["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "key": {"type": "string", "description": "the key."},
            "default": {"type": "string", "description": "the answer when the key is missing."},
        },
        "required": ["key"],
    }
    # extra_info neither described nor typed
    assert tools["secret"].takes_extra_info
    assert tools["secret"].schema["function"] == {
        "name": "secret",
        "description": "Tell the row's secret.",
        "parameters": {"type": "object", "properties": {}},
        "return": {"type": "string"},
    }
    # string annotations
    assert tools["quoted"].schema["function"]["parameters"] == {
        "type": "object", "properties": {"n": {"type": "integer", "description": "how many times."}}, "required": ["n"]
    }


def test_schema_dicts_full_and_bare():
    full = {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
    bare = {"name": "fetch", "description": "Fetch a page."}
    tools = build_tools([full, bare, add], "envs/web.py", call_tool=lambda name, arguments, extra_info: "")
    assert tools["search"] == Tool("search", full, None, False)
    assert tools["fetch"] == Tool("fetch", {"type": "function", "function": {
        "name": "fetch", "description": "Fetch a page.", "parameters": {"type": "object", "properties": {}}
    }}, None, False)
    assert tools["add"].fn is add


def no_doc(x: int) -> int:
    return x


def half_doc(x: int, y: int) -> int:
    """Half documented.

    Args:
        x: a number.
    """
    return x


def untyped(x) -> int:
    """Untyped.

    Args:
        x: a number.
    """
    return x


@pytest.mark.parametrize(
    "specs, message",
    [
        ([add, add], "envs/e.py: two tools are named 'add'; rename one of them"),
        ([no_doc], "envs/e.py: tool 'no_doc' has no docstring; give it one"),
        ([half_doc], "envs/e.py: cannot make the schema of tool 'half_doc': "),
        ([half_doc], "no description for the argument 'y'"),
        ([untyped], "envs/e.py: cannot make the schema of tool 'untyped': Argument x is missing a type hint"),
        ([{"type": "function", "function": {"description": "nameless"}}], "envs/e.py: the tool schema "),
        ([{"description": "nameless"}], "has no function name; write {\"type\": \"function\", \"function\": {\"name\""),
        ([{"name": "search"}], "envs/e.py: tool 'search' is a schema without a Python function; define "
                               "`call_tool(name, arguments, extra_info)` in envs/e.py"),
        ([42], "envs/e.py: tool 42 (int) is neither a Python function nor an OpenAI schema dict"),
    ],
)
def test_build_tools_errors_name_the_script_and_the_tool(specs, message):
    with pytest.raises(ValueError) as raised:
        build_tools(specs, "envs/e.py")
    assert message in str(raised.value)


# ---- run_tool ----

TOOLS = build_tools([add, lookup, secret, weather, boom, own_timeout, nothing, opaque], "envs/t.py")


@pytest.mark.parametrize(
    "tool_call, content",
    [
        (call("add", a=2, b=3), "5"),
        (call("lookup", key="fr"), "Paris"),  # async, with extra_info
        (call("lookup", key="xx", default="?"), "?"),
        (call("secret"), "Zürich"),
        (call("weather", city="Zürich"), '{"city": "Zürich", "temps": [1.5, 2]}'),
        (call("nothing"), "null"),
        (call("opaque"), "<opaque thing>"),
    ],
)
def test_run_tool_results_as_text(tool_call, content):
    result = run(TOOLS, tool_call, {"table": {"fr": "Paris"}, "secret": "Zürich"})
    assert (result.call, result.content, result.error) == (tool_call, content, None)
    assert result.seconds >= 0


@pytest.mark.parametrize(
    "tool_call, content, error",
    [
        (call("sub", a=1), "Error: unknown tool 'sub'; the tools are: add, lookup, secret, weather, boom, own_timeout, "
                           "nothing, opaque", "unknown_tool"),
        (call("add", a=1), "Error: bad arguments for add: missing a required argument: 'b'; its parameters are: a, b",
         "bad_arguments"),
        (call("add", a=1, b=2, c=3), "Error: bad arguments for add: got an unexpected keyword argument 'c'; "
                                     "its parameters are: a, b", "bad_arguments"),
        (call("lookup", key="fr", extra_info={}), "Error: bad arguments for lookup: got an unexpected keyword "
                                                  "argument 'extra_info'; its parameters are: key, default (optional)",
         "bad_arguments"),
        (call("boom", x=-1), "Error: boom raised ValueError: x=-1 must be positive", "raised"),
        # the tool's own TimeoutError is an exception it raised, not run_tool's timeout
        (call("own_timeout"), "Error: own_timeout raised TimeoutError: the upstream service timed out", "raised"),
    ],
)
def test_run_tool_errors_are_observations(tool_call, content, error):
    result = run(TOOLS, tool_call, {"table": {}})
    assert (result.content, result.error) == (content, error)


def test_async_tool_timeout():
    async def hang(x: int) -> str:
        """Never return.

        Args:
            x: anything.
        """
        await asyncio.sleep(30)

    result = run(build_tools([hang], "envs/t.py"), call("hang", x=1), timeout=0.1)
    assert (result.content, result.error) == ("Error: hang did not return within 0.1 s", "timeout")
    assert 0.1 <= result.seconds < 10  # the tool hangs for 30 s


def test_blocking_sync_tool_times_out():
    release = threading.Event()

    def stuck() -> str:
        """Block the thread."""
        release.wait(30)
        return "late"

    async def main():
        start = time.perf_counter()
        result = await run_tool(build_tools([stuck], "envs/t.py"), call("stuck"), {}, 0.2)
        elapsed = time.perf_counter() - start
        release.set()  # lets the worker thread end, so that the event loop can close
        return result, elapsed

    result, elapsed = asyncio.run(main())
    assert (result.content, result.error) == ("Error: stuck did not return within 0.2 s", "timeout")
    assert 0.2 <= result.seconds < 10 and elapsed < 10  # the tool blocks for 30 s


def test_a_sleeping_sync_tool_leaves_the_event_loop_free():
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long.
        """
        time.sleep(seconds)
        return "awake"

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        result = await run_tool(build_tools([slow], "envs/t.py"), call("slow", seconds=0.3), {}, 5.0)
        task.cancel()
        return result, ticks

    result, ticks = asyncio.run(main())
    assert (result.content, result.error) == ("awake", None)
    assert result.seconds >= 0.3
    # About 30 ticks while the tool sleeps; none if the sleep had held the event loop.
    assert ticks >= 5


@pytest.mark.parametrize("is_async", [False, True])
def test_schema_only_tools_run_through_call_tool(is_async):
    seen = []

    def sync_call_tool(name, arguments, extra_info):
        seen.append((name, arguments, extra_info))
        return [f"result for {arguments['q']}"]

    async def async_call_tool(name, arguments, extra_info):
        return sync_call_tool(name, arguments, extra_info)

    call_tool = async_call_tool if is_async else sync_call_tool
    tools = build_tools([{"name": "search", "description": "Search."}], "envs/t.py", call_tool=call_tool)
    result = run(tools, call("search", q="rl"), {"row": 7}, call_tool=call_tool)
    assert (result.content, result.error) == ('["result for rl"]', None)
    assert seen == [("search", {"q": "rl"}, {"row": 7})]


def test_tool_result_messages():
    results = [ToolResult(ToolCall("add", {"a": 1}, "call_0"), "3", None, 0.1),
               ToolResult(ToolCall("zap", {}, "call_1"), "Error: unknown tool 'zap'", "unknown_tool", 0.0)]
    assert tool_result_messages(results) == [
        {"role": "tool", "content": "3", "tool_call_id": "call_0", "name": "add"},
        {"role": "tool", "content": "Error: unknown tool 'zap'", "tool_call_id": "call_1", "name": "zap"},
    ]


# ---- rendering ----

SCHEMA = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
SCHEMA_LINE = ('{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": '
               '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, '
               '"required": ["a", "b"]}}}')
TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + SCHEMA_LINE
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
    "The results come back within <tool_response></tool_response> XML tags."
)
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

# Qwen2.5-Instruct's chat template (as published), which shows tools in the system prompt and tool
# results as <tool_response> blocks of a user turn.
QWEN25_TEMPLATE = (Path(__file__).parents[1] / "data" / "chat_templates" / "qwen2.5.jinja").read_text()


@pytest.fixture(scope="module")
def qwen_tok(tok):
    qwen = copy.deepcopy(tok)
    qwen.chat_template = QWEN25_TEMPLATE
    return qwen


def conversation(arguments) -> list[dict]:
    """System, user, an assistant that calls add twice (OpenAI shape), and both results."""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": arguments}}
             for i in range(2)]
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": calls},
        {"role": "tool", "content": "3", "tool_call_id": "call_0", "name": "add"},
        {"role": "tool", "content": "3", "tool_call_id": "call_1", "name": "add"},
    ]


# What both renderings write after the system turn (the Qwen template and the fallback render these alike).
TURNS = (
    "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
    f"<|im_start|>assistant\nAdding.\n{CALL_TEXT}\n{CALL_TEXT}<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_tool_system_prompt():
    assert tool_system_prompt([SCHEMA]) == TOOL_PROMPT


def test_template_renders_tools(tok, qwen_tok):
    assert not template_renders_tools(tok)  # SmolLM2's ChatML template ignores tools=
    assert template_renders_tools(qwen_tok)
    no_template = copy.deepcopy(tok)
    no_template.chat_template = None
    assert not template_renders_tools(no_template)


@pytest.mark.parametrize("arguments", ['{"a": 1, "b": 2}', {"a": 1, "b": 2}])  # OpenAI's string, or a dict
def test_fallback_rendering(tok, arguments):
    text = render_conversation(tok, conversation(arguments), [SCHEMA], HermesParser(), native=False)
    assert text == f"<|im_start|>system\n{TOOL_PROMPT}\n\nBe brief.<|im_end|>\n" + TURNS


def test_fallback_rendering_without_a_system_message_or_tools(tok):
    user = [{"role": "user", "content": "hi"}]
    assert render_conversation(tok, user, [SCHEMA], HermesParser(), native=False) == (
        f"<|im_start|>system\n{TOOL_PROMPT}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_conversation(tok, user, None, HermesParser(), native=False) == (
        SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("arguments", ['{"a": 1, "b": 2}', {"a": 1, "b": 2}])
def test_native_rendering(qwen_tok, arguments):
    text = render_conversation(qwen_tok, conversation(arguments), [SCHEMA], HermesParser(), native=True)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + SCHEMA_LINE
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        + TURNS
    )


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("system", [[], [{"role": "system", "content": "Be brief."}]])
def test_the_next_turn_extends_the_tokens_already_sampled(tok, qwen_tok, native, system):
    """Re-rendering after the sampled text and a tool result starts with what the policy saw and wrote,
    so that one token sequence carries on across turns."""
    tokenizer = qwen_tok if native else tok
    messages = [*system, {"role": "user", "content": "What is 1 + 2?"}]
    first = render_conversation(tokenizer, messages, [SCHEMA], HermesParser(), native)
    sampled = f"Let me add.\n{CALL_TEXT}"  # what the model wrote, up to the stop string
    messages += [{"role": "assistant", "content": sampled},
                 {"role": "tool", "content": "3", "tool_call_id": "call_0", "name": "add"}]
    second = render_conversation(tokenizer, messages, [SCHEMA], HermesParser(), native)
    assert second == (first + sampled + "<|im_end|>\n"
                      "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
