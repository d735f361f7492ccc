"""Agent scripts: agent code written against the `openai` client, rolled out as trajectories.

The file defines `async def run(client: openai.AsyncOpenAI, extra_info: dict) -> float | dict` (a reward,
or {"reward", "score", "reward_parts"}). `client` talks to the rollout's OpenAI-compatible endpoint
(`RL2.agents.openai_server`), which records every call's tokens; `extra_info` is a copy of the row's
`extra_info` with its prompt under "prompt". The reward goes on the trajectory's last turn. An agent that
raises, runs past the timeout, returns a malformed result or never calls the model ends its own
trajectory with reward 0; a failure of the engine stops the rollout. See docs/agents.md.
"""

import asyncio
import copy
import numbers
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import openai

from RL2.agents.openai_server import OpenAIEndpoint
from RL2.rollout.env import EnvError, EnvFault, check_coroutine, load_script, parse_reward
from RL2.rollout.loop import gather_or_cancel, sample_seed
from RL2.rollout.trajectory import Trajectory

# What an agent's result dict may hold.
RESULT_KEYS = ("reward", "score", "reward_parts")


@dataclass
class Agent:
    """A loaded agent script and its `run`. `reset_fn` and `tool_specs` are what an environment script may
    define and an agent never does (it starts from the row's prompt and runs its own tools): a trainer reads
    either alike."""

    path: str
    run_fn: Callable[[openai.AsyncOpenAI, dict], Awaitable[float | dict]]
    reset_fn = None
    tool_specs = ()


def load_agent(path: str) -> Agent:
    """Import an agent script.

    Args:
        path: the Python file defining `async def run(client, extra_info)`.
    """
    file, module = load_script(path, "agent script",
                               "point to a Python file defining `async def run(client, extra_info) -> float | dict`",
                               "rl2_agent_")
    run = getattr(module, "run", None)
    if run is None:
        raise EnvError(f"{file} defines no `run`; add `async def run(client, extra_info) -> float | dict`, "
                       f"where client is an openai.AsyncOpenAI")
    check_coroutine(file, "run", run, "client, extra_info")
    return Agent(path=str(file), run_fn=run)


async def agent_rollout_batch(
    endpoint: OpenAIEndpoint,
    agent: Agent,
    prompts: list[dict],
    responses_per_prompt: int,
    timeout: float | None,
) -> list[list[Trajectory]]:
    """Run the agent `responses_per_prompt` times per prompt, all runs concurrently, each in its own session.

    Args:
        endpoint: the rank's OpenAI endpoint (started here if it is not yet).
        agent: the agent script.
        prompts: rows with `prompt` (text or chat messages; `messages` instead where a row keeps
            both, its prompt being their rendering), optionally `extra_info` and
            `sampling_seed`: run j of a row with a seed samples its call k with
            `sample_seed(sample_seed(seed, j), k)` (as `rollout_batch` seeds turns).
        responses_per_prompt: runs per prompt (a GRPO group).
        timeout: seconds one run may take. None: no limit.

    Returns:
        One group of trajectories per prompt, in order. The first engine failure met by a call is
        raised once the run that met it ends (the other runs are cancelled).
    """
    await endpoint.start()
    # One connection pool for every client of the batch: a client of its own would build one per run.
    http = openai.DefaultAsyncHttpxClient(timeout=None)
    try:
        tasks = [
            [asyncio.create_task(_run(endpoint, agent, row, j, timeout, http)) for j in range(responses_per_prompt)]
            for row in prompts
        ]
        await gather_or_cancel([task for group in tasks for task in group])
    finally:
        await http.aclose()
    return [[task.result() for task in group] for group in tasks]


async def _run(endpoint: OpenAIEndpoint, agent: Agent, row: dict, index: int, timeout: float | None,
               http) -> Trajectory:
    """One run of the agent, as one trajectory."""
    seed = row.get("sampling_seed")
    session = endpoint.open_session(None if seed is None else sample_seed(seed, index))
    trajectory = session.trajectory
    # A row that keeps its chat messages (its `prompt` is then their rendering) gives the agent the messages.
    prompt = row.get("messages") or row.get("prompt")
    extra_info = copy.deepcopy(row.get("extra_info") or {}) | {"prompt": copy.deepcopy(prompt)}
    trajectory.extra_info = extra_info
    client = openai.AsyncOpenAI(base_url=endpoint.base_url_of(session), api_key="rl2", max_retries=0,
                                http_client=http)
    start = time.perf_counter()
    try:
        fault = await _outcome(agent, client, extra_info, timeout, trajectory)
    finally:
        endpoint.close_session(session)
    if session.error is not None:  # the engine failed, not the agent: the rollout stops
        raise session.error
    trajectory.tool_seconds = max(0.0, time.perf_counter() - start - trajectory.generate_seconds)
    if fault is None and not trajectory.turns:
        fault = "the agent made no model call"
    if fault is not None:
        trajectory.fail(fault)
    else:
        trajectory.stop_reason = "done"
    return trajectory


async def _outcome(agent: Agent, client: openai.AsyncOpenAI, extra_info: dict, timeout: float | None,
                   trajectory: Trajectory) -> str | None:
    """Run the agent and put its reward on the trajectory's last turn; a description of its fault, if any."""
    try:
        result = await asyncio.wait_for(agent.run_fn(client, extra_info), timeout)
    except TimeoutError:
        return f"the agent did not return within {timeout} s"
    except Exception as e:  # the script runs on untrusted model output: whatever it raises ends this trajectory only
        return f"the agent raised {type(e).__name__}: {e}"
    try:
        reward, score, parts = parse_agent_result(result)
    except EnvFault as e:
        return f"malformed agent result: {e}"
    if trajectory.turns:
        last = trajectory.turns[-1]
        last.reward, last.score, last.reward_parts = reward, score, parts
    return None


def parse_agent_result(result: object) -> tuple[float, float, dict[str, float]]:
    """(reward, score, reward_parts) of what `run` returned: a number, or a dict with `reward` and
    optionally `score` (default: reward) and `reward_parts`; raises `EnvFault` otherwise."""
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        result = {"reward": result}
    if not isinstance(result, dict):
        raise EnvFault(f"run returned {type(result).__name__}, not a number or a dict with a reward")
    if "reward" not in result:
        raise EnvFault(f"run's result has no 'reward'; it has {sorted(result)}")
    unknown = sorted(set(result) - set(RESULT_KEYS))
    if unknown:
        raise EnvFault(f"run's result has unknown keys {unknown}; it may hold {', '.join(RESULT_KEYS)}")
    return parse_reward(result, "run's result")
