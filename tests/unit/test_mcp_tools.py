"""The tools of MCP servers (RL2.rollout.tools.mcp_servers): a real server of the `mcp` package
(tests/envs/mcp_server.py) over stdio, started by an environment script, and over streamable HTTP on 127.0.0.1,
started here. The schemas expected are what the server itself declares, read in-process from its module; the
rollouts run on the real embedded engine serving a tiny random Llama, whose calls come from a scripted parser."""

import asyncio
import dataclasses
import importlib.util
import json
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from transformers.utils import get_json_schema

from RL2.agents.agent import agent_rollout_batch, load_agent
from RL2.agents.endpoint import OpenAIEndpoint
from RL2.rollout.env import EnvError, load_env
from RL2.rollout.loop import EnvRollout, run_trajectory
from RL2.rollout.metrics import rollout_metrics
from RL2.rollout.tools import mcp_servers
from RL2.rollout.tools.declared import build_tools, run_tool
from RL2.rollout.tools.mcp_servers import MCPServers
from RL2.rollout.tools.tool_calls import HermesParser, ParsedAction, ToolCall
from RL2.rollout.tools.tool_use import tool_use_of
from tests.helpers import ENVS, REPO
from tests.helpers.engines import ScriptedParser as Scripted
from tests.helpers.engines import running_engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
QUESTION = [{"role": "user", "content": "What is 6 times 7?"}]
CFG = SimpleNamespace(tool_parser="hermes", tool_timeout=5.0, tool_error="observe", tool_call_stop=True)


def module_of(file: str):
    spec = importlib.util.spec_from_file_location(f"mcp_test_{file.removesuffix('.py')}", ENVS / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def declared_schemas() -> list[dict]:
    """The server's tools as it declares them (listed in-process), in the OpenAI format."""
    listed = asyncio.run(module_of("mcp_server.py").server.list_tools())
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}} for t in listed]


def shown_schemas(prompt: str) -> list[dict]:
    """The schemas of the tools block of RL2's default (Hermes) format, a JSON line each."""
    block = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    return [json.loads(line) for line in block.splitlines()]


@pytest.fixture(scope="module")
def env():
    env = load_env(ENVS / "mcp_tools.py")
    yield env
    env.mcp.close()


@pytest.fixture(scope="module")
def http_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, str(ENVS / "mcp_server.py"), str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "the HTTP MCP server did not start"
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def http_servers(http_url):
    servers = MCPServers([{"url": http_url}], "test.py")
    yield servers
    servers.close()


@pytest.fixture(scope="module", params=["stdio", "http"])
def tools(request, env):
    return env.mcp.tools if request.param == "stdio" else request.getfixturevalue("http_servers").tools


def test_the_servers_tools_are_listed_as_it_declares_them_and_rendered_after_the_scripts_own(env, tools, tok):
    assert [tool.schema for tool in tools.values()] == declared_schemas()
    use = tool_use_of(env, CFG, tok)
    assert list(use.tools) == ["count_chars", "multiply", "capital", "wait", "crash"]
    # SmolLM2's template shows no tools: RL2's Hermes block lists the schemas, a JSON line each.
    rendered = use.render(QUESTION, tok)
    assert shown_schemas(rendered) == [get_json_schema(module_of("mcp_tools.py").count_chars), *declared_schemas()]
    assert rendered.endswith(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
                             .split("<|im_end|>\n", 1)[1])  # after the system turn: the question


def test_calls_give_results_and_errors_as_observations(tools):
    async def call(name: str, timeout: float = 5.0, **arguments):
        return await run_tool(tools, ToolCall(name, arguments, "call_0"), {}, timeout)

    async def main():
        return await asyncio.gather(call("multiply", a=6, b=7), call("capital", country="Peru"),
                                    call("capital", country="Atlantis"), call("multiply", a="six"),
                                    call("wait", 0.2, seconds=30.0))

    results = asyncio.run(main())
    assert [r.content for r in results[:2]] == ["42", "Lima"] and [r.error for r in results[:2]] == [None, None]
    assert results[2].error == "raised" and results[2].content.startswith("Error: ")
    assert "no country named Atlantis" in results[2].content
    assert results[3].error == "raised" and "valid integer" in results[3].content
    assert (results[4].error, results[4].content) == ("timeout", "Error: wait did not return within 0.2 s")
    # The connection outlives a call that timed out (and an event loop of its caller).
    assert asyncio.run(call("multiply", a=2, b=3)).content == "6"


def test_a_server_that_dies_fails_the_call_and_is_started_anew_for_the_next():
    servers = MCPServers([{"command": [sys.executable, str(ENVS / "mcp_server.py")]}], "test.py")

    async def call(name: str, **arguments):
        return await run_tool(servers.tools, ToolCall(name, arguments, "call_0"), {}, 10.0)

    try:
        crashed = asyncio.run(call("crash"))
        assert crashed.error == "raised" and crashed.content.startswith("Error: crash raised MCPError: ")
        assert asyncio.run(call("multiply", a=6, b=7)).content == "42"
    finally:
        servers.close()
    closed = asyncio.run(call("multiply", a=6, b=7)).content
    assert closed == "Error: the connection to the MCP server of multiply is closed"


@pytest.mark.parametrize("spec, message", [
    ({"command": ["/nonexistent/mcp-server"]}, r"MCP server /nonexistent/mcp-server did not start: FileNotFoundError"),
    ({"name": "quits", "command": [sys.executable, "-c", "pass"]}, r"MCP server 'quits' \(.*-c pass\) did not start: "
                                                                   r".*Connection closed \(the server exited"),
    ({"url": "http://127.0.0.1:9/mcp"}, r"MCP server http://127.0.0.1:9/mcp did not start: ConnectError"),
    ({"command": [sys.executable, "-c", "import time; time.sleep(30)"]},
     r"MCP server .*time.sleep\(30\).* did not start and list its tools within 0.5 s"),
    ({"cmd": "server"}, r"MCP server \{'cmd': 'server'\} is neither \{\"command\""),
    ({"url": "http://127.0.0.1:9/mcp", "env": {}}, r"MCP server .* has unknown keys \['env'\]"),
    ({"command": "python server.py", "env": {"N": 1}},
     r"MCP server python server.py: env\.N: Input should be a valid string"),
])
def test_a_server_that_does_not_start_fails_the_load_naming_the_script_and_the_server(tmp_path, monkeypatch, spec,
                                                                                      message):
    monkeypatch.setattr(mcp_servers, "START_TIMEOUT_S", 0.5)
    script = tmp_path / "env.py"
    script.write_text(f"MCP_SERVERS = [{spec!r}]\n\nasync def step(state, action, extra_info):\n"
                      f"    return {{'reward': 0.0, 'done': True}}\n")
    with pytest.raises(EnvError, match=f"{script}: {message}"):
        load_env(script)


def test_an_agent_naming_servers_must_take_tools(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text("MCP_SERVERS = [{'url': 'http://127.0.0.1:9/mcp'}]\n\nasync def run(client, extra_info):\n"
                      "    return 0.0\n")
    with pytest.raises(EnvError, match="names MCP_SERVERS, and its `run` takes no `tools`"):
        load_agent(script)


@pytest.fixture(scope="module")
def engine(tiny_model_path, tok):
    yield from running_engine(tiny_model_path, tok, max_running_requests=8)


@pytest.mark.parametrize("on_error", ["observe", "end"])
def test_an_environment_rollout_calls_the_server(engine, tok, env, on_error):
    calls = [ToolCall("multiply", {"a": 6, "b": 7}, "call_0"), ToolCall("count_chars", {"text": "abc"}, "call_1")]
    script = [ParsedAction("", calls), ParsedAction("", [ToolCall("capital", {"country": "Atlantis"}, "call_0")])]
    use = dataclasses.replace(tool_use_of(env, CFG, tok), parser=Scripted(script), on_error=on_error)
    trajectory = asyncio.run(run_trajectory(EnvRollout(engine, env, tok, tool_use=use, max_turns=4), QUESTION, {},
                                            sampling_params=GREEDY))
    results = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert results[:2] == ["42", "3"] and (trajectory.tool_calls, trajectory.tool_errors) == (3, 1)
    if on_error == "observe":
        assert (trajectory.stop_reason, trajectory.reward, trajectory.n_turns) == ("done", 1.0, 3)
        assert results[2].startswith("Error: ") and "no country named Atlantis" in results[2]
        metrics = rollout_metrics([[trajectory]], tools=True)
        assert (metrics["rollout/tool_calls"], metrics["rollout/tool_errors"]) == (3, 1)
    else:
        assert trajectory.stop_reason == "fault" and "rollout.tool_error=end" in trajectory.fault
        assert "no country named Atlantis" in trajectory.fault


@pytest.fixture(scope="module")
def agent():
    agent = load_agent(ENVS / "mcp_agent.py", tool_timeout=5.0)
    yield agent
    agent.mcp.close()


@pytest.mark.parametrize("on_error", ["observe", "end"])
def test_an_agent_calls_the_servers_tools_through_its_toolbox(engine, tok, agent, on_error):
    async def main():
        endpoint = OpenAIEndpoint(engine, tok, HermesParser(), False, GREEDY, None)
        try:
            return await agent_rollout_batch(endpoint, dataclasses.replace(agent, tool_error=on_error),
                                             [{"prompt": QUESTION}], 1, 30.0)
        finally:
            await endpoint.stop()

    [[trajectory]] = asyncio.run(main())
    assert trajectory.tool_errors == 1
    if on_error == "observe":
        assert (trajectory.fault, trajectory.reward, trajectory.metrics) == (None, 1.0, {"saw_error": 1.0})
        # The model was shown the server's tools as it declares them (RL2's Hermes block for SmolLM2's template).
        assert shown_schemas(trajectory.prompt_text) == declared_schemas()
    else:
        assert trajectory.fault.startswith("a tool call failed (Error: ")
        assert trajectory.fault.endswith("rollout.tool_error=end")


def test_the_shipped_examples_serve_the_calculator_next_to_search():
    env = load_env(REPO / "envs" / "mcp_tool_use.py")
    try:
        assert list(build_tools(env.tool_specs, env.path)) == ["search", "multiply", "add"]
        call = ToolCall("multiply", {"a": 123, "b": 456}, "call_0")
        assert asyncio.run(run_tool(env.mcp.tools, call, {}, 5.0)).content == str(123 * 456)
    finally:
        env.mcp.close()
    agent = load_agent(REPO / "envs" / "mcp_tool_use_agent.py")
    try:
        assert agent.takes_tools and list(agent.tools) == ["multiply", "add"]
    finally:
        agent.mcp.close()
