"""Environment scripts: one Python file whose `async def step(state, action, extra_info) -> dict` turns the policy's
actions into rewards, optionally with `async def reset(extra_info)`, `TOOLS` and `MCP_SERVERS`; a state is text or a
list of chat messages (docs/rl.md, "Environments"). The original releases' scripts run as they are
(`RL2.compat.env_protocol`, docs/compatibility.md).
"""

import inspect
import math
import numbers
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from RL2.compat.env_protocol import adapt_script
from RL2.utils.imports import import_file

State = str | list[dict]


class EnvError(ValueError):
    """The environment script cannot be used (missing file, no async `step`, ...)."""


class EnvFault(Exception):
    """A `step` result that breaks the contract; it ends one trajectory, not the run."""


class TooManyTimeouts(RuntimeError):
    """A script's calls ran out of time `rollout.max_consecutive_timeouts` times in a row: the run stops."""


@dataclass
class StepResult:
    next_state: State | None
    reward: float
    score: float
    done: bool
    extra_info: dict
    reward_parts: dict[str, float] = field(default_factory=dict)


@dataclass
class Env:
    """A loaded environment script: its `step`, `reset` (if any), tools (`TOOLS`, then its MCP servers'), `call_tool`,
    which runs schema-only tools, and `mcp`, the connections to its MCP servers (`MCPServers`), if it names any."""

    path: str
    step_fn: Callable[[str, str, dict], Awaitable[dict]]
    reset_fn: Callable[[dict], Awaitable[State]] | None = None
    tool_specs: list = field(default_factory=list)
    call_tool: Callable | None = None
    mcp: object | None = None
    timeouts_in_a_row: int = 0  # steps and resets that ran out of time since one last ended otherwise

    def __post_init__(self):  # what the original releases' scripts expect beyond this protocol (RL2.compat)
        self._step, self._reset = adapt_script(self.step_fn, self.reset_fn)

    async def step(self, state: str, action: str, extra_info: dict) -> StepResult:
        """Run the script's `step`; raises `EnvFault` when its result is malformed."""
        return parse_step_result(await self._step(state, action, extra_info), extra_info)

    async def reset(self, extra_info: dict) -> State:
        if self.reset_fn is None:
            raise EnvError(f"{self.path} defines no `reset`, so every prompt row needs a prompt")
        state = await self._reset(extra_info)
        if not _is_state(state):
            raise EnvError(f"{self.path}: reset returned {type(state).__name__}, not a str or a list of messages")
        if not state:  # the engine cannot sample after no tokens
            raise EnvError(f"{self.path}: reset returned an empty state for extra_info={extra_info!r:.200}; "
                           f"return the first prompt the policy answers")
        return state


def load_env(path: str) -> Env:
    """Import the environment script at `path`, which defines `async def step(...)` (and maybe `reset`)."""
    file, module = load_script(path, "environment script", "point to a Python file such as envs/countdown.py",
                               "rl2_env_")
    step = getattr(module, "step", None)
    if step is None:
        raise EnvError(f"{file} defines no `step`; add "
                       f"`async def step(state: str, action: str, extra_info: dict) -> dict`")
    reset = getattr(module, "reset", None)
    check_coroutine(file, "step", step, "state, action, extra_info")
    if reset is not None:
        check_coroutine(file, "reset", reset, "extra_info")
    tools = getattr(module, "TOOLS", None) or []
    if not isinstance(tools, (list, tuple)):
        raise EnvError(f"{file}: TOOLS is {type(tools).__name__}; make it a list of functions or OpenAI schema dicts")
    servers = open_mcp_servers(module, file)
    return Env(path=str(file), step_fn=step, reset_fn=reset,
               tool_specs=[*tools, *(servers.tools.values() if servers else ())],
               call_tool=getattr(module, "call_tool", None), mcp=servers)


def open_mcp_servers(module: ModuleType, file: Path):
    """The `MCPServers` of the script's `MCP_SERVERS` (started, their tools listed), or None when it names none."""
    specs = getattr(module, "MCP_SERVERS", None)
    if not specs:
        return None
    try:  # the `mcp` package (the extra RL2[mcp]), needed only by the scripts that name servers
        from RL2.rollout.tools.mcp_servers import MCPServers
    except ImportError as e:
        raise EnvError(f"{file} names MCP_SERVERS, which needs the mcp package ({e}); pip install 'RL2[mcp]'") from None
    try:
        return MCPServers(specs, str(file))
    except ValueError as e:
        raise EnvError(str(e)) from None


def load_script(path: str, what: str, hint: str, prefix: str) -> tuple[Path, ModuleType]:
    """The file at `path` and the module it defines, imported (named `prefix` + the file's stem); an
    `EnvError` names `what` and gives `hint` when there is no such file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise EnvError(f"{what} {file} does not exist; {hint}")
    return file, import_file(file, prefix)


def check_coroutine(file: Path, name: str, fn: Callable, params: str) -> None:
    """Fail at start, not on every action of the run, when the script's `name` is no async function of `params`."""
    if not inspect.iscoroutinefunction(fn):
        raise EnvError(f"{file}: `{name}` must be async (`async def {name}({params})`) so that trajectories run "
                       f"concurrently")
    try:
        inspect.signature(fn).bind(*params.split(", "))
    except TypeError as e:
        raise EnvError(f"{file}: `{name}` must accept ({params}): {e}") from None


def parse_step_result(result: object, extra_info: dict) -> StepResult:
    """Check a `step` result; `score` defaults to `reward` and `extra_info` to the one passed in."""
    if not isinstance(result, dict):
        raise EnvFault(f"step returned {type(result).__name__}, not a dict")
    missing = [key for key in ("reward", "done") if key not in result]
    if missing:
        raise EnvFault(f"step result has no {missing}; it has {sorted(result)}")
    reward, score, parts = parse_reward(result, "step result")
    if not isinstance(result["done"], bool):
        raise EnvFault(f"step result done={result['done']!r} is not a bool")
    next_state = result.get("next_state")
    if not result["done"] and not _is_state(next_state):
        raise EnvFault(f"step result next_state={next_state!r:.80} is not a str or a list of messages (done is False)")
    if not result["done"] and not next_state:  # it does not extend state + action: a new sequence of no tokens
        raise EnvFault("step result next_state is empty (done is False); to go on without an observation "
                       "return state + action, else done=True")
    new_info = result.get("extra_info", extra_info)
    if not isinstance(new_info, dict):
        raise EnvFault(f"step result extra_info is {type(new_info).__name__}, not a dict")
    return StepResult(next_state, reward, score, result["done"], new_info, parts)


def parse_reward(result: dict, what: str) -> tuple[float, float, dict[str, float]]:
    """A result's `reward`, `score` (default: reward) and `reward_parts` (default: none), checked to be
    finite numbers; raises `EnvFault`, naming the result `what` ("step result"), otherwise."""
    reward, score = result["reward"], result.get("score", result["reward"])
    parts = result.get("reward_parts") or {}
    if not isinstance(parts, dict):
        raise EnvFault(f"{what} reward_parts is {type(parts).__name__}, not a dict of name -> number")
    for key, value in (("reward", reward), ("score", score), *((f"reward_parts[{n!r}]", v) for n, v in parts.items())):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise EnvFault(f"{what} {key}={value!r} is not a finite number")
    for name in parts:
        if (bad := not_text(str(name))) is not None:
            raise EnvFault(f"{what} reward_parts name {name!r} {bad}")
    return float(reward), float(score), {str(name): float(value) for name, value in parts.items()}


def not_text(text: str) -> str | None:
    """Why `text` is no Unicode text (a str may hold a lone surrogate such as "\\ud800", which neither the
    tokenizer nor a UTF-8 file takes), or None when it is."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"is not valid Unicode text: {text[e.start:e.end]!r} at character {e.start} is a lone surrogate; "
                f"decode the bytes it came from with errors='replace'")
    return None


def _is_state(state: object) -> bool:
    return isinstance(state, str) or (isinstance(state, list) and all(isinstance(m, dict) for m in state))
