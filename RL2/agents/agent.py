"""Agent scripts (`async def run(client: openai.AsyncOpenAI, extra_info) -> float | dict`, docs/agents.md), each run
one trajectory, its `client` talking to the rank's endpoint (`RL2.agents.endpoint`) from the environments' loop
(`on_env_loop`): an agent that fails ends its own trajectory as a fault, a failure of the engine stops the rollout."""

import asyncio
import copy
import inspect
import math
import numbers
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from RL2.agents.endpoint import OpenAIEndpoint
from RL2.rollout.env import (
    EnvError,
    EnvFault,
    TooManyTimeouts,
    check_coroutine,
    load_script,
    open_mcp_servers,
    parse_reward,
)
from RL2.rollout.event_loop import Escaped
from RL2.rollout.loop import call_script, engine_sampling_params, gather_or_cancel, sample_seed
from RL2.rollout.tools.declared import Tool
from RL2.rollout.tools.tool_use import ToolBox
from RL2.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from RL2.agents.clients import Pools

# What an agent's result dict may hold.
RESULT_KEYS = ("reward", "score", "reward_parts", "metrics")


@dataclass
class Agent:
    """A loaded agent script and its `run`; a `run` that takes `tools` gets a `ToolBox` of its MCP servers' `tools`
    each run. `timeouts_in_a_row` counts its runs that timed out since one last ended otherwise."""

    path: str
    run_fn: Callable[..., Awaitable[float | dict]]
    takes_tools: bool = False
    tools: dict[str, Tool] = field(default_factory=dict)
    mcp: object | None = None  # the connections to its MCP servers (`MCPServers`), if it names any
    tool_timeout: float | None = None
    tool_error: str = "observe"
    timeouts_in_a_row: int = 0


def load_agent(path: str, tool_timeout: float | None = None, tool_error: str = "observe") -> Agent:
    """Import an agent script: the Python file at `path` defining `async def run(client, extra_info)`, or
    `run(client, extra_info, tools)` to call the tools of the MCP servers it names (their connections opened
    here), under `tool_timeout` and `tool_error` (rollout.tool_timeout, rollout.tool_error)."""
    file, module = load_script(path, "agent script",
                               "point to a Python file defining `async def run(client, extra_info) -> float | dict`",
                               "rl2_agent_")
    run = getattr(module, "run", None)
    if run is None:
        raise EnvError(f"{file} defines no `run`; add `async def run(client, extra_info) -> float | dict`, "
                       f"where client is an openai.AsyncOpenAI")
    takes_tools = callable(run) and "tools" in inspect.signature(run).parameters
    check_coroutine(file, "run", run, "client, extra_info, tools" if takes_tools else "client, extra_info")
    if getattr(module, "MCP_SERVERS", None) and not takes_tools:
        raise EnvError(f"{file} names MCP_SERVERS, and its `run` takes no `tools` to call them with; write "
                       f"`async def run(client, extra_info, tools)`")
    servers = open_mcp_servers(module, file)
    return Agent(str(file), run, takes_tools, dict(servers.tools) if servers else {}, servers, tool_timeout,
                 tool_error)


@dataclass(frozen=True)
class AgentRollout:
    """An agent script's rollout on a rank (the rollout worker's driver): each run one trajectory, its model
    calls served by the rank's endpoint under the rollout's sampling config."""

    endpoint: OpenAIEndpoint
    agent: Agent
    timeout: float | None = None  # seconds one run may take (`rollout.agent_timeout`); None: no limit
    max_timeouts: int | None = None  # runs in a row that may time out (rollout.max_consecutive_timeouts); None: any

    def batch(self, prompts: list[dict], responses_per_prompt: int, sampling_params):
        """`agent_rollout_batch`, calls without sampling params of their own sampling with `sampling_params`."""
        self.endpoint.default_sampling = engine_sampling_params(sampling_params)
        return agent_rollout_batch(self.endpoint, self.agent, prompts, responses_per_prompt, self.timeout,
                                   self.max_timeouts)


async def agent_rollout_batch(endpoint: OpenAIEndpoint, agent: Agent, prompts: list[dict], responses_per_prompt: int,
                              timeout: float | None, max_timeouts: int | None = None) -> list[list[Trajectory]]:
    """Run the agent `responses_per_prompt` times per prompt (a GRPO group), all runs concurrently, each in its
    own session of `endpoint` (started here if it is not yet); one group of trajectories per prompt, in order.
    `timeout`, `max_timeouts` as in `AgentRollout`. An engine failure is raised once the run that met it ends.
    `prompts` are rows with `prompt` (or `messages`, where a row keeps both), optionally `extra_info` and
    `sampling_seed`: run j samples its call k with `sample_seed(sample_seed(seed, j), k)` (as `rollout_batch`)."""
    from RL2.agents.clients import Pools  # openai, here: ~0.3 s of start-up that runs without agents would pay

    await endpoint.start()
    pools = Pools()
    try:
        tasks = [[asyncio.create_task(_run(endpoint, agent, row, j, timeout, max_timeouts, pools))
                  for j in range(responses_per_prompt)] for row in prompts]
        await gather_or_cancel([task for group in tasks for task in group])
    finally:
        await pools.aclose()
    return [[task.result() for task in group] for group in tasks]


async def _run(endpoint: OpenAIEndpoint, agent: Agent, row: dict, index: int, timeout: float | None,
               max_timeouts: int | None, pools: "Pools") -> Trajectory:
    """One run of the agent, as one trajectory."""
    seed = row.get("sampling_seed")
    session = endpoint.open_session(None if seed is None else sample_seed(seed, index))
    trajectory = session.trajectory
    # A row that keeps its chat messages (its `prompt` is then their rendering) gives the agent the messages.
    prompt = row.get("messages") or row.get("prompt")
    extra_info = copy.deepcopy(row.get("extra_info") or {}) | {"prompt": copy.deepcopy(prompt)}
    trajectory.extra_info, trajectory.row = extra_info, row.get("row")
    tools = ToolBox(agent.tools, agent.tool_timeout, agent.tool_error, trajectory, extra_info)

    async def run() -> object:  # on the loop of user code
        arguments = (pools.client(base_url, endpoint.api_key), extra_info, *([tools] if agent.takes_tools else []))
        return await agent.run_fn(*arguments)

    start = time.perf_counter()
    try:
        base_url = endpoint.base_url_of(session)
        fault = await _outcome(agent, run(), timeout, max_timeouts, trajectory)
    finally:
        endpoint.close_session(session)
    if session.error is not None:  # the engine failed, not the agent: the rollout stops
        raise session.error
    trajectory.tool_seconds = max(0.0, time.perf_counter() - start - trajectory.generate_seconds)
    if session.over_budget is not None:  # whatever the agent made of the refusal
        fault = session.over_budget
    elif tools.fault is not None:  # a failed tool call under rollout.tool_error=end, whatever the agent made of it
        fault = tools.fault
    elif fault is None and not trajectory.turns:
        fault = "the agent made no model call"
    if fault is not None:
        trajectory.fail(fault)
    else:
        trajectory.stop_reason = "done"
    return trajectory


async def _outcome(agent: Agent, run, timeout: float | None, max_timeouts: int | None,
                   trajectory: Trajectory) -> str | None:
    """Await `run` and put its reward on the trajectory's last turn; a description of its fault, if any."""
    try:
        result = await call_script(agent, run, timeout, max_timeouts, "rollout.agent_timeout")
    except TooManyTimeouts:
        raise
    except TimeoutError:
        return f"the agent did not return within {timeout} s"
    except Escaped as e:
        return f"the agent raised {e}"
    except Exception as e:  # the script runs on untrusted model output: whatever it raises ends this trajectory only
        return f"the agent raised {type(e).__name__}: {e}"
    try:
        reward, score, parts = parse_agent_result(result)
        trajectory.metrics = parse_agent_metrics(result)
    except EnvFault as e:
        return f"malformed agent result: {e}"
    if trajectory.turns:
        last = trajectory.turns[-1]
        last.reward, last.score, last.reward_parts = reward, score, parts
    return None


def parse_agent_metrics(result: object) -> dict[str, float]:
    """The agent's own metrics of what `run` returned (a result dict's `metrics`: name -> finite number, each
    logged as `rollout/agent/<name>`, the mean over the runs that give it); raises `EnvFault` when malformed."""
    metrics = result.get("metrics") if isinstance(result, dict) else None
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise EnvFault(f"run's result metrics is {type(metrics).__name__}, not a dict of name -> number")
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise EnvFault(f"run's result metrics[{name!r}]={value!r} is not a finite number")
    return {str(name): float(value) for name, value in metrics.items()}


def parse_agent_result(result: object) -> tuple[float, float, dict[str, float]]:
    """(reward, score, reward_parts) of what `run` returned: a number, or a dict with `reward` and
    optionally `score` (default: reward), `reward_parts` and `metrics`; raises `EnvFault` otherwise."""
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        result = {"reward": result}
    if not isinstance(result, dict):
        raise EnvFault(f"run returned {type(result).__name__}, not a number or a dict with a reward")
    if "reward" not in result:
        raise EnvFault(f"run's result has no 'reward'; it has {sorted(result)}")
    if unknown := sorted(set(result) - set(RESULT_KEYS)):
        raise EnvFault(f"run's result has unknown keys {unknown}; it may hold {', '.join(RESULT_KEYS)}")
    return parse_reward(result, "run's result")
