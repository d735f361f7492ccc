"""The tools of the MCP servers a script names in `MCP_SERVERS` (stdio `{"command": [...]}`, or streamable HTTP
`{"url": ...}`), run as its own TOOLS. The connections live on an event loop and thread of their own: the tools are
listed before any rollout runs, outside any loop, and the loop of user code that calls them may be abandoned to a
tool that blocks it. See docs/agents.md, "The tools of MCP servers".
"""

import asyncio
import atexit
import json
import shlex
from dataclasses import dataclass, field

import mcp
import pydantic

from RL2.loop_thread import LoopThread
from RL2.rollout.tools.declared import Tool, ToolError

START_TIMEOUT_S = 60.0  # seconds a server has to start and list its tools
LOST = ("connection closed", "session terminated")  # what an error says when the connection is gone
CLOSE_TIMEOUT_S = 10.0  # seconds `close` waits for the servers to shut down (a stdio one is then killed)


@dataclass(eq=False)
class _Connection:
    """One server's connection: what `mcp.Client` connects to, and the task that holds it open."""

    label: str  # how messages name the server
    server: object  # a URL or `mcp.StdioServerParameters`
    client: mcp.Client | None = None
    task: asyncio.Task | None = None
    lost: bool = False  # a call found it closed (the server exited, the connection dropped): the next reconnects
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class MCPServers:
    """The connections to a script's MCP servers, and their tools (`tools`, by name, for `build_tools`)."""

    def __init__(self, specs: list, where: str):
        """Start or connect to each server of `specs` and list its tools; a `ValueError` names `where`, the server."""
        if not isinstance(specs, (list, tuple)):
            raise ValueError(f"{where}: MCP_SERVERS is {type(specs).__name__}; make it a list of "
                             f'{{"command": [...]}} or {{"url": "http://..."}} dicts')
        self._connections = [_Connection(*_server(spec, where)) for spec in specs]
        self._where, self._closed = where, False
        self.tools: dict[str, Tool] = {}
        self._thread = LoopThread("rl2-mcp-servers")
        self._closing = asyncio.Event()
        atexit.register(self.close)
        try:
            listings = self._thread.submit(self._connect_all()).result()
            for connection, listed in zip(self._connections, listings, strict=True):
                for listed_tool in listed:
                    if listed_tool.name in self.tools:
                        raise ValueError(f"{where}: two tools are named {listed_tool.name!r} (one of MCP server "
                                         f"{connection.label}); a tool's name must be unique among the script's "
                                         f"TOOLS and MCP servers")
                    self.tools[listed_tool.name] = self._tool(connection, listed_tool)
        except BaseException:
            self.close()
            raise

    async def _connect_all(self) -> list[list]:
        return await asyncio.gather(*(self._connect(connection) for connection in self._connections))

    async def _connect(self, connection: _Connection) -> list:
        """Open `connection` (anew, after a loss); the tools the server lists."""
        listed = asyncio.get_running_loop().create_future()
        connection.task = asyncio.create_task(self._serve(connection, listed))
        where, label = self._where, connection.label
        try:
            return await asyncio.wait_for(asyncio.shield(listed), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ValueError(f"{where}: MCP server {label} did not start and list its tools within "
                             f"{START_TIMEOUT_S:g} s") from None
        except Exception as e:
            raise ValueError(f"{where}: MCP server {label} did not start: {_reason(e)}") from None
        finally:
            if not listed.done() or listed.exception() is not None:
                listed.cancel()
                connection.task.cancel()

    async def _serve(self, connection: _Connection, listed: asyncio.Future) -> None:
        """Hold one connection open until `close` (its context is entered and left in this one task)."""
        try:
            async with mcp.Client(connection.server) as client:
                tools, cursor = [], None
                while True:  # a server may list its tools in pages
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    if not (cursor := page.next_cursor):
                        break
                connection.client = client
                listed.set_result(tools)
                await self._closing.wait()
        except BaseException as e:  # noqa: BLE001 -- handed to whoever waits for the listing; a later loss fails calls
            if not listed.done():
                listed.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))

    def _tool(self, connection: _Connection, listed: mcp.types.Tool) -> Tool:
        """A tool that calls `listed` on the server, from any event loop."""
        async def call(**arguments) -> str:
            if self._closed:
                raise ToolError(f"the connection to the MCP server of {listed.name} is closed")
            return await asyncio.wrap_future(self._thread.submit(self._call(connection, listed.name, arguments)))

        schema = {"type": "function", "function": {"name": listed.name, "description": listed.description or "",
                                                   "parameters": listed.input_schema}}
        return Tool(listed.name, schema, call, False)

    async def _call(self, connection: _Connection, name: str, arguments: dict) -> str:
        """The text of a tool's result; raises `ToolError` with it when the server marks it an error. A call that
        finds the connection closed fails, and the next connects again (a stdio server is started anew)."""
        async with connection.lock:  # one reconnection for all the calls that wait
            if connection.lost:
                connection.task.cancel()
                await self._connect(connection)
                connection.lost = False
        try:
            result = await connection.client.call_tool(name, arguments)
        except mcp.MCPError as e:  # a server of the stateful HTTP protocol may also end an idle session
            connection.lost = connection.lost or any(lost in str(e).lower() for lost in LOST)
            raise
        texts = [block.text if block.type == "text" else f"[{block.type} content]" for block in result.content]
        if not texts and result.structured_content is not None:
            texts = [json.dumps(result.structured_content, ensure_ascii=False)]
        text = "\n".join(texts)
        if result.is_error:
            raise ToolError(text)
        return text

    def close(self) -> None:
        """Close the connections (stdio servers exit) and stop their loop; a second call does nothing."""
        if self._closed:
            return
        self._closed = True

        async def close_all() -> None:
            self._closing.set()
            tasks = [connection.task for connection in self._connections if connection.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)

        try:
            self._thread.submit(close_all()).result(CLOSE_TIMEOUT_S + 1)
        finally:
            self._thread.stop()
            atexit.unregister(self.close)


def _server(spec: object, where: str) -> tuple[str, object]:
    """A server of MCP_SERVERS as (how messages name it, what `mcp.Client` connects to)."""
    if not isinstance(spec, dict) or ("command" in spec) == ("url" in spec):
        raise ValueError(f'{where}: MCP server {spec!r:.120} is neither {{"command": [...]}} (stdio) nor '
                         f'{{"url": "http://..."}} (streamable HTTP)')
    unknown = set(spec) - ({"name", "url"} if "url" in spec else {"name", "command", "env", "cwd"})
    if unknown:
        raise ValueError(f"{where}: MCP server {spec!r:.120} has unknown keys {sorted(unknown)}; it may hold name "
                         f"and url, or name, command, env and cwd")
    if "url" in spec:
        server = label = spec["url"]
        if not isinstance(server, str) or not server.startswith(("http://", "https://")):
            raise ValueError(f"{where}: MCP server url {server!r} is not an http:// or https:// URL")
    else:
        command = shlex.split(spec["command"]) if isinstance(spec["command"], str) else spec["command"]
        if not (isinstance(command, (list, tuple)) and command and all(isinstance(a, str) for a in command)):
            raise ValueError(f"{where}: MCP server command {spec['command']!r} is not a command line (a string or "
                             f"a list of strings)")
        label = shlex.join(command)
        try:  # the server gets mcp's safe environment (HOME, PATH, ...) with `env` over it
            server = mcp.StdioServerParameters(command=command[0], args=list(command[1:]), env=spec.get("env"),
                                               cwd=spec.get("cwd"))
        except pydantic.ValidationError as e:  # `env` not a dict of strings, `cwd` not a path
            problems = "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in e.errors())
            raise ValueError(f"{where}: MCP server {label}: {problems}") from None
    return (f"{spec['name']!r} ({label})" if spec.get("name") else label), server


def _reason(error: BaseException) -> str:
    """What went wrong, from the one error inside task groups' exception groups."""
    while len(getattr(error, "exceptions", ())) == 1:  # an ExceptionGroup
        error = error.exceptions[0]
    if isinstance(error, mcp.MCPError) and "closed" in str(error).lower():
        return f"{error} (the server exited or is no MCP server: see its output above)"
    return f"{type(error).__name__}: {error}"
