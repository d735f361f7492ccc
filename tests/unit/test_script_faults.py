"""User code that misbehaves beyond raising an exception (issue #54: environments and agent scripts) ends
its own trajectory, never the run, and costs the healthy trajectories nothing: a `CancelledError`, text
with lone surrogates, blocking code (`time.sleep`, a loop that never returns) in a step or an agent, and
`sys.exit()` or `KeyboardInterrupt` in an agent. The real embedded engine serves a tiny random Llama.

A step or agent that "never returns" spins until the test releases it (`RELEASE`), so that its thread does
not spin on through the other tests of the process.
"""

import asyncio
import json
import time

import pytest

from RL2.agents.agent import agent_rollout_batch, load_agent
from RL2.agents.endpoint import OpenAIEndpoint
from RL2.config import ConfigError, parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.rollout import event_loop
from RL2.rollout.env import load_env
from RL2.rollout.event_loop import run_on_rank_loop
from RL2.rollout.loop import EnvRollout, rollout_batch, run_trajectory
from RL2.rollout.metrics import fault_summary, rollout_metrics, save_samples
from RL2.rollout.tools.declared import build_tools
from RL2.rollout.tools.tool_calls import HermesParser, ParsedAction, ToolCall, ToolCallParser
from RL2.rollout.tools.tool_use import ToolUse
from RL2.sandbox import SandboxError
from tests.helpers.engines import running_engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}

ENV = '''
import asyncio
import sys
import threading
import time

RELEASE = threading.Event()  # the test sets it to end the steps that "never return"


async def reset(extra_info):
    if extra_info.get("reset") == "cancel":
        raise asyncio.CancelledError()
    return "Play.\\ud800" if extra_info.get("reset") == "surrogate" else "Play."


async def leave(code):
    sys.exit(code)


async def step(state, action, extra_info):
    kind = extra_info.get("kind", "ok")
    extra_info["n"] = extra_info.get("n", 0) + 1
    if kind == "cancel":
        raise asyncio.CancelledError()
    if kind == "task_exit":  # sys.exit() in a task the step made: asyncio re-raises it out of the loop
        await asyncio.gather(leave(6))
    if kind == "observation":
        return {"next_state": state + action + "\\ud800", "reward": 1.0, "done": False}
    if kind == "message":
        raise ValueError("bad \\ud800 text")
    if kind == "part":
        return {"reward": 1.0, "done": True, "reward_parts": {"\\ud800": 1.0}}
    if kind == "sleep" and extra_info["n"] == 1:  # blocking code in an async step
        time.sleep(extra_info.get("block_s", 2.0))
    if kind == "spin" and extra_info["n"] == 1:  # `while True: pass`, until the test is over
        while not RELEASE.is_set():
            pass
    if kind == "hang":
        await asyncio.sleep(30)
    if kind == "no_sandbox":  # as code_reward raises where solutions cannot be isolated
        from RL2.sandbox import SandboxError
        raise SandboxError("the code sandbox cannot isolate solutions here")
    return {"next_state": state + action, "reward": 1.0, "done": extra_info["n"] == extra_info.get("turns", 1)}
'''

AGENT = '''
import asyncio
import sys
import threading
import time

RELEASE = threading.Event()


async def run(client, extra_info):
    mode = extra_info["mode"]
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
    if mode == "exit":
        sys.exit(3)
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "cancel":
        raise asyncio.CancelledError()
    if mode == "sleep":
        time.sleep(2.0)
    if mode == "spin":
        while not RELEASE.is_set():
            pass
    if mode == "hang":
        await asyncio.sleep(30)
    return 1.0
'''


@pytest.fixture(scope="module")
def engine(tiny_model_path, tok):
    yield from running_engine(tiny_model_path, tok, max_running_requests=16)


@pytest.fixture
def env(tmp_path):
    (tmp_path / "env.py").write_text(ENV)
    env = load_env(tmp_path / "env.py")
    yield env
    env.step_fn.__globals__["RELEASE"].set()


@pytest.fixture
def agent(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    agent = load_agent(tmp_path / "agent.py")
    yield agent
    agent.run_fn.__globals__["RELEASE"].set()


@pytest.fixture
def quick_to_abandon(monkeypatch):
    """A blocked loop is taken to be blocked sooner, to keep the tests short."""
    monkeypatch.setattr(event_loop, "BLOCKED_AFTER_S", 0.3)


def roll(engine, tok, env, kinds: list[dict], n: int = 1, **kwargs):
    rows = [{"prompt": "Hi", "extra_info": extra} for extra in kinds]
    return run_on_rank_loop(rollout_batch(EnvRollout(engine, env, tok, **{"max_turns": 3} | kwargs), rows, n, GREEDY))


# ---- item 6: a CancelledError and text that is no Unicode text ----


def test_a_step_or_reset_that_raises_cancelled_error_ends_its_own_trajectory(engine, tok, env):
    rows = [{"prompt": "Hi", "extra_info": {"kind": "cancel"}}, {"prompt": None, "extra_info": {"reset": "cancel"}},
            {"prompt": "Hi", "extra_info": {}}]
    [[step], [reset], [fine]] = run_on_rank_loop(rollout_batch(EnvRollout(engine, env, tok), rows, 1, GREEDY))
    assert (step.fault, step.reward) == ("step raised CancelledError", 0.0)
    assert (reset.fault, reset.n_turns) == ("reset raised CancelledError", 0)
    assert fine.fault is None and fine.reward == 1.0


def test_a_step_whose_own_task_exits_ends_its_own_trajectory(engine, tok, env):
    # Before, the SystemExit stopped the environments' loop and thread, and the rollout waited for ever.
    for _ in range(2):  # the loop is still there for the next rollout
        [[exited], [fine]] = roll(engine, tok, env, [{"kind": "task_exit"}, {}])
        assert (exited.fault, fine.fault, fine.reward) == ("step raised SystemExit: 6", None, 1.0)


@pytest.mark.parametrize("extra, fault", [
    ({"kind": "observation"}, "malformed next_state: it is not valid Unicode text: '\\ud800' at character"),
    ({"kind": "message"}, "step raised ValueError: bad \\ud800 text"),  # the escape, not the surrogate
    ({"kind": "part"}, "reward_parts name '\\ud800' is not valid Unicode text"),
    ({"reset": "surrogate"}, "malformed state: it is not valid Unicode text"),
], ids=["observation", "exception_message", "reward_part_name", "reset_state"])
def test_text_with_a_lone_surrogate_ends_its_own_trajectory_and_everything_stays_writable(engine, tok, env, tmp_path,
                                                                                          extra, fault):
    rows = [{"prompt": None if "reset" in extra else "Hi", "extra_info": extra}, {"prompt": "Hi", "extra_info": {}}]
    groups = run_on_rank_loop(rollout_batch(EnvRollout(engine, env, tok, max_turns=3), rows, 1, GREEDY))
    [[bad], [fine]] = groups
    assert fault in bad.fault and bad.reward == 0.0 and fine.fault is None and fine.reward == 1.0
    save_samples(tmp_path / "samples.jsonl", groups, 1)
    [first, second] = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text("utf-8").splitlines()]
    assert first["fault"] == bad.fault and second["reward"] == 1.0
    json.dumps([rollout_metrics(groups), fault_summary(groups)], ensure_ascii=False).encode("utf-8")


def test_samples_keep_a_lone_surrogate_of_a_prompt_as_its_json_escape(engine, tok, env, tmp_path):
    [[trajectory]] = roll(engine, tok, env, [{}])
    trajectory.sequences[0].prompt_text += "\ud800"  # a row's prompt, tokenised beforehand (`prompt_ids`)
    save_samples(tmp_path / "samples.jsonl", [[trajectory]], 1)
    assert "\\ud800" in (tmp_path / "samples.jsonl").read_text("utf-8")
    assert json.loads((tmp_path / "samples.jsonl").read_text("utf-8"))["prompt"].endswith("\ud800")


# ---- item 7: blocking steps, and timeouts in a row ----


def test_a_blocking_step_costs_the_healthy_trajectories_nothing(engine, tok, env, quick_to_abandon):
    # 1 prompt in 4 blocks its first step for 2 s under a 0.3 s limit; the others take three turns each. Before,
    # the healthy steps queued behind it timed out too, in this rollout and the next.
    for _ in range(2):
        groups = roll(engine, tok, env, [{"kind": "sleep", "turns": 3}] + [{"turns": 3}] * 3, n=2, env_timeout=0.3)
        assert [t.fault for t in groups[0]] == ["step timed out after 0.3 s"] * 2
        assert [(t.fault, t.reward, t.n_turns) for g in groups[1:] for t in g] == [(None, 3.0, 3)] * 6


def test_a_step_that_never_returns_leaves_the_later_steps_a_loop_of_their_own(engine, tok, env, quick_to_abandon):
    [[spinning], [fine]] = roll(engine, tok, env, [{"kind": "spin"}, {}], env_timeout=0.3)
    assert spinning.fault == "step timed out after 0.3 s" and fine.fault is None
    groups = roll(engine, tok, env, [{}] * 4, env_timeout=0.3)  # before: every later step timed out
    assert [t.fault for g in groups for t in g] == [None] * 4


def test_timeouts_in_a_row_stop_the_rollout_naming_the_key(engine, tok, env):
    # A step that returns in between starts the count again: 2 timeouts, 1 step, 2 timeouts go on.
    for rows in ([{"kind": "hang"}] * 2, [{}], [{"kind": "hang"}] * 2):
        roll(engine, tok, env, rows, env_timeout=0.5, max_timeouts=3)
    with pytest.raises(Exception, match=r"3 calls of .*env\.py in a row ran out of time \(rollout\.env_timeout=0\.5 s\)"
                                        r".*raise rollout\.max_consecutive_timeouts") as raised:
        roll(engine, tok, env, [{"kind": "hang"}], env_timeout=0.5, max_timeouts=3)
    assert type(raised.value).__name__ == "TooManyTimeouts"


def test_a_sandbox_that_cannot_isolate_stops_the_rollout_with_its_message(engine, tok, env):
    """Not a fault of one trajectory: the sandbox refuses every solution (probed once, one message), so the
    run stops with that message instead of faulting every trajectory of every step."""
    with pytest.raises(SandboxError, match="cannot isolate solutions here"):
        roll(engine, tok, env, [{"kind": "no_sandbox"}, {}])


@pytest.mark.parametrize("value", ["0", "-2"])
def test_max_consecutive_timeouts_is_at_least_1_or_null(value):
    env = "rollout.env_path=envs/countdown.py"
    assert parse_config(PPOConfig, "ppo", [env]).rollout.max_consecutive_timeouts == 32
    off = parse_config(PPOConfig, "ppo", [env, "rollout.max_consecutive_timeouts=null"])
    assert off.rollout.max_consecutive_timeouts is None
    with pytest.raises(ConfigError, match=rf"rollout\.max_consecutive_timeouts={value}; .*or null never to stop"):
        parse_config(PPOConfig, "ppo", [env, f"rollout.max_consecutive_timeouts={value}"])


class Scripted(ToolCallParser):
    """Reads every action as a call of `name`, then as an answer."""

    name = "scripted"

    def __init__(self, name: str):
        self.calls = [ParsedAction("", [ToolCall(name, {}, "call_0")])]

    def parse(self, text: str) -> ParsedAction:
        return self.calls.pop(0) if self.calls else ParsedAction(content=text)


@pytest.mark.parametrize("raised, message", [("SystemExit(5)", "SystemExit: 5"),
                                             ("asyncio.CancelledError()", "CancelledError")], ids=["exit", "cancel"])
def test_a_tool_that_exits_gives_an_error_result(engine, tok, tmp_path, raised, message):
    (tmp_path / "tools_env.py").write_text(
        "import asyncio\n\n\nasync def leave() -> str:\n    \"\"\"Leave.\"\"\"\n    raise " + raised + "\n\n\n"
        "TOOLS = [leave]\n\n\nasync def step(state, action, extra_info):\n    return {'reward': 1.0, 'done': True}\n")
    env = load_env(tmp_path / "tools_env.py")
    use = ToolUse(build_tools(env.tool_specs, env.path), None, Scripted("leave"), native=False)
    trajectory = asyncio.run(run_trajectory(EnvRollout(engine, env, tok, max_turns=3, tool_use=use),
                                            [{"role": "user", "content": "Hi"}], {}, GREEDY))
    assert (trajectory.fault, trajectory.reward, trajectory.tool_errors) == (None, 1.0, 1)
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == [f"Error: a tool raised {message}"]


# ---- item 8: agent scripts ----


def roll_agents(engine, tok, agent, modes: list[str], timeout: float, during=None, **kwargs):
    """Each mode's run, with `during()` awaited on the rank's loop alongside the rollout."""
    async def main():
        endpoint = OpenAIEndpoint(engine, tok, HermesParser(), False, GREEDY, None)
        rows = [{"prompt": "Hi", "extra_info": {"mode": mode}} for mode in modes]
        try:
            return await asyncio.gather(agent_rollout_batch(endpoint, agent, rows, 1, timeout, **kwargs),
                                        during() if during else asyncio.sleep(0))
        finally:
            await endpoint.stop()

    return run_on_rank_loop(main())


@pytest.mark.parametrize("mode, fault", [("exit", "the agent raised SystemExit: 3"),
                                         ("interrupt", "the agent raised KeyboardInterrupt"),
                                         ("cancel", "the agent raised CancelledError")],
                         ids=["exit", "interrupt", "cancel"])
def test_an_agent_that_exits_ends_its_own_run(engine, tok, agent, mode, fault):
    [[bad], [fine]], _ = roll_agents(engine, tok, agent, [mode, "ok"], timeout=30.0)
    assert (bad.fault, bad.reward, bad.n_turns) == (fault, 0.0, 1)
    assert (fine.fault, fine.reward) == (None, 1.0)


async def longest_pause(seconds: float = 2.5) -> float:
    """The longest the rank's loop went without running this coroutine, over `seconds`."""
    longest, last, end = 0.0, time.perf_counter(), time.perf_counter() + seconds
    while time.perf_counter() < end:
        await asyncio.sleep(0.02)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


def test_a_blocking_agent_freezes_neither_the_rank_loop_nor_the_endpoint_and_times_out(engine, tok, agent,
                                                                                       quick_to_abandon):
    # Before, the agent's time.sleep(2.0) froze the rank's loop (engine, endpoint) for 2 s, and it then
    # returned its reward 1.0 past its 0.5 s timeout.
    [[blocked]], pause = roll_agents(engine, tok, agent, ["sleep"], timeout=0.5, during=longest_pause)
    assert (blocked.fault, blocked.reward) == ("the agent did not return within 0.5 s", 0.0)
    assert pause < 1.0


def test_an_agent_that_never_returns_leaves_the_later_runs_a_loop_of_their_own(engine, tok, agent, quick_to_abandon):
    [[spinning]], _ = roll_agents(engine, tok, agent, ["spin"], timeout=0.5)
    assert spinning.fault == "the agent did not return within 0.5 s"
    groups, _ = roll_agents(engine, tok, agent, ["ok", "ok"], timeout=5.0)  # before: the rank's loop was stuck
    assert [(t.fault, t.reward) for [t] in groups] == [(None, 1.0)] * 2


def test_agent_runs_that_time_out_in_a_row_stop_the_rollout_naming_the_key(engine, tok, agent):
    # A run that ends in between starts the count again (given time to end on a busy machine).
    for modes, timeout in ((["hang"], 0.5), (["ok"], 30.0), (["hang"], 0.5)):
        roll_agents(engine, tok, agent, modes, timeout=timeout, max_timeouts=2)
    with pytest.raises(Exception, match=r"2 calls of .*agent\.py in a row ran out of time "
                                        r"\(rollout\.agent_timeout=0\.5 s\).*rollout\.max_consecutive_timeouts"):
        roll_agents(engine, tok, agent, ["hang", "hang"], timeout=0.5, max_timeouts=2)
