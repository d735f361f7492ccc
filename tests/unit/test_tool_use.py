"""Tools in the environment loop, on the real embedded engine serving a tiny random Llama.

The tiny model never writes a tool call of its own, so the policy's calls come from a parser that
reads each action as the test's next scripted call: everything after the parsing (running the tools,
the conversation, its rendering and token layout, the counts) is RL2's. The expected token layout is
built independently: the conversation written out by hand in RL2's default format (Hermes-style
system block, results as <tool_response> user turns) and rendered by the chat template.
"""

import asyncio
import json
from types import SimpleNamespace

import pytest

from RL2.datasets.prompts import prompt_row_tokenizer
from RL2.datasets.tokenize import BadRow
from RL2.rollout.env import load_env
from RL2.rollout.loop import EnvRollout, run_trajectory
from RL2.rollout.metrics import rollout_metrics
from RL2.rollout.tools.declared import build_tools
from RL2.rollout.tools.tool_calls import ParsedAction, ToolCall, tool_call_parser
from RL2.rollout.tools.tool_use import ToolUse, tool_use_of
from RL2.rollout.trajectory import Trajectory
from tests.helpers import ENVS
from tests.helpers.engines import ScriptedParser as Scripted
from tests.helpers.engines import running_engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
QUESTION = [{"role": "user", "content": "How long is this?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_path, tok):
    yield from running_engine(tiny_model_path, tok, max_running_requests=8)


@pytest.fixture(scope="module")
def env():
    return load_env(ENVS / "tools.py")


def tool_use(env, script: list[ParsedAction], **settings) -> ToolUse:
    return ToolUse(build_tools(env.tool_specs, env.path), None, Scripted(script), native=False, **settings)


def roll(engine, tok, env, use: ToolUse, extra_info: dict | None = None, **kwargs) -> Trajectory:
    kwargs = {"sampling_params": GREEDY, "max_turns": 6} | kwargs
    settings = {key: kwargs.pop(key) for key in ("max_turns", "max_total_tokens", "env_timeout") if key in kwargs}
    return asyncio.run(run_trajectory(EnvRollout(engine, env, tok, tool_use=use, **settings), QUESTION,
                                      extra_info or {}, **kwargs))


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments, "call_0")


def system_block(env) -> str:
    lines = "\n".join(json.dumps(tool.schema) for tool in build_tools(env.tool_specs, env.path).values())
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
            "The results come back within <tool_response></tool_response> XML tags.")


def test_tool_turns_run_the_calls_and_the_answer_is_stepped_in_one_sequence(engine, tok, env):
    script = [ParsedAction("", [call("count_chars", text="abc")]),
              ParsedAction("", [call("count_chars", text="hello")])]
    trajectory = roll(engine, tok, env, tool_use(env, script), {"offset": 10})
    assert (trajectory.n_turns, trajectory.stop_reason, trajectory.tool_calls, trajectory.tool_errors) == (
        3, "done", 2, 0)
    assert [turn.reward for turn in trajectory.turns] == [0.0, 0.0, 1.0]  # tool turns earn nothing themselves
    assert trajectory.tool_seconds > 0 and trajectory.generate_seconds > 0

    # The conversation, written out by hand: the tools read extra_info (offset 10).
    actions = [turn.action_text for turn in trajectory.turns]
    messages = [{"role": "system", "content": system_block(env)}, *QUESTION]
    texts = [tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)]
    for action, result in zip(actions, ["13", "15"]):
        messages += [{"role": "assistant", "content": action},
                     {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"}]
        texts.append(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert trajectory.messages[-1]["content"] == "15" and trajectory.state == texts[-1]

    [sequence] = trajectory.token_sequences()
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    expected, mask = encode(texts[0]), [0] * len(encode(texts[0]))
    for k, turn in enumerate(trajectory.turns):
        expected += turn.action_ids
        mask += [1] * len(turn.action_ids)
        if k < 2:  # the template's text after what the model sampled: masked out
            added = encode(texts[k + 1][len(texts[k]) + len(actions[k]):])
            expected += added
            mask += [0] * len(added)
    assert sequence["input_ids"] == expected and sequence["loss_mask"] == mask


def test_failing_calls_become_error_results_and_are_counted(engine, tok, env):
    failing = [call("nope"), call("count_chars", txt="x"), call("broken"), call("slow", seconds=5.0)]
    script = [ParsedAction("", failing, errors=["tool call is not JSON: <tool_call>{oops"])]
    trajectory = roll(engine, tok, env, tool_use(env, script, timeout=0.1))
    assert (trajectory.stop_reason, trajectory.reward, trajectory.fault) == ("done", 1.0, None)
    assert (trajectory.tool_calls, trajectory.tool_errors, trajectory.parse_errors) == (4, 4, 1)
    results = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert results[0].startswith("Error: unknown tool 'nope'") and "count_chars, slow, broken" in results[0]
    assert results[1].startswith("Error: bad arguments for count_chars")
    assert results[2] == "Error: broken raised RuntimeError: broken tool"
    assert results[3] == "Error: slow did not return within 0.1 s"
    assert results[4] == "Error: the tool call could not be parsed: tool call is not JSON: <tool_call>{oops"
    metrics = rollout_metrics([[trajectory]], tools=True)
    assert (metrics["rollout/tool_calls"], metrics["rollout/tool_errors"], metrics["rollout/tool_parse_errors"]) == (
        4, 4, 1)
    assert 0 < metrics["rollout/tool_time_share"] < 1


@pytest.mark.parametrize("script, reason", [
    ([ParsedAction("", [call("broken")])], "a tool call failed (Error: broken raised RuntimeError: broken tool)"),
    ([ParsedAction("", [], errors=["tool call is not JSON: {"])], "a tool call could not be parsed"),
])
def test_with_tool_error_end_a_failing_call_ends_the_trajectory_as_a_fault(engine, tok, env, script, reason):
    trajectory = roll(engine, tok, env, tool_use(env, script, on_error="end"))
    assert trajectory.stop_reason == "fault" and reason in trajectory.fault and trajectory.reward == 0.0


def test_tool_turns_count_against_max_turns(engine, tok, env):
    script = [ParsedAction("", [call("count_chars", text="a")])] * 3
    trajectory = roll(engine, tok, env, tool_use(env, script), max_turns=2)
    assert (trajectory.stop_reason, trajectory.n_turns, trajectory.reward, trajectory.tool_calls) == (
        "max_turns", 2, 0.0, 2)


def test_an_environment_declares_tools_and_the_run_config_picks_the_format(env, tok):
    cfg = SimpleNamespace(tool_parser="auto", tool_timeout=5.0, tool_error="observe", tool_call_stop=True)
    use = tool_use_of(env, cfg, tok)
    assert list(use.tools) == ["count_chars", "slow", "broken"] and use.parser.name == "hermes" and not use.native
    assert use.sampling_params({"stop": ["</answer>"]})["stop"] == ["</answer>", "</tool_call>"]
    assert use.sampling_params({"stop": ["</tool_call>"]})["stop"] == ["</tool_call>"]
    assert "stop" not in tool_use_of(env, SimpleNamespace(**vars(cfg) | {"tool_call_stop": False}),
                                     tok).sampling_params({})
    assert tool_use_of(load_env(ENVS / "echo.py"), cfg, tok) is None
    with pytest.raises(ValueError, match="rollout.tool_parser: .*nonsense"):
        tool_use_of(env, SimpleNamespace(**vars(cfg) | {"tool_parser": "nonsense"}), tok)
    assert tool_call_parser("auto", tok).name == "hermes"


def test_prompt_rows_show_the_tools_and_keep_their_messages(env, tok):
    use = tool_use(env, [])
    split = SimpleNamespace(prompt_key="prompt", messages_key="messages", apply_chat_template=True, max_length=4096)
    row = prompt_row_tokenizer(tok, tool_use=use)(split)({"prompt": "How long is this?", "answer": 3})
    expected = tok.apply_chat_template([{"role": "system", "content": system_block(env)}, *QUESTION],
                                       add_generation_prompt=True, tokenize=False)
    assert (row["prompt"], row["messages"], row["extra_info"]) == (expected, QUESTION, {"answer": 3})
    assert row["prompt_ids"] == tok.encode(expected, add_special_tokens=False)
    with pytest.raises(BadRow, match="declares TOOLS"):
        prompt_row_tokenizer(tok, tool_use=use)(SimpleNamespace(**vars(split) | {"apply_chat_template": False}))(
            {"prompt": "How long is this?"})


def test_a_checkpointed_trajectory_keeps_its_conversation_and_tool_counts():
    trajectory = Trajectory(extra_info={}, messages=QUESTION, tool_calls=2, tool_errors=1, tool_seconds=0.5)
    restored = Trajectory.from_dict(trajectory.to_dict())
    assert (restored.messages, restored.tool_calls, restored.tool_errors, restored.tool_seconds) == (
        QUESTION, 2, 1, 0.5)
    # A checkpoint written before these fields existed still loads.
    old = {key: value for key, value in trajectory.to_dict().items() if key not in ("messages", "tool_calls")}
    assert Trajectory.from_dict(old).tool_calls == 0
