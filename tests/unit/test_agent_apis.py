"""The endpoint's streaming and its other APIs (OpenAI's Responses, Anthropic's Messages), through the real `openai`
and `anthropic` clients and their stream helpers, on the embedded engine serving a tiny random Llama (greedy), with
the bundled model's tokenizer and chat template; and the example agent scripts of envs/, one run each.

Expected tokens come from an independent greedy loop of full forwards over the prompt the chat template renders.
"""

import asyncio
import json

import anthropic
import openai
import pytest

from RL2.agents.agent import agent_rollout_batch, load_agent
from RL2.agents.endpoint import OpenAIEndpoint
from RL2.rollout.metrics import rollout_metrics
from RL2.rollout.tools.declared import render_conversation
from RL2.rollout.tools.tool_calls import HermesParser
from tests.helpers import REPO
from tests.helpers.reference import greedy, token_logps
from tests.unit.test_openai_endpoint import (
    ECHO_PARAMETERS,
    QUESTION,
    TOOLS,
    EchoCalls,
    RecordingEngine,
    chat,
    encode,
    model,  # noqa: F401 (the module's fixture)
)

N = 12  # tokens per answer: enough text for several deltas
GREEDY = {"temperature": 0.0, "max_new_tokens": N, "ignore_eos": True}
# The tiny model's greedy answer to a chat prompt is newlines: text is sampled, with a seed.
SAMPLED = {"temperature": 1.0, "max_new_tokens": N, "ignore_eos": True}
SEED = {"seed": 11}
SYSTEM = [{"role": "system", "content": "Be brief."}]
RESPONSE_TOOLS = [{"type": "function", "name": "echo", "description": "Repeat the text.",
                   "parameters": ECHO_PARAMETERS}]
ANTHROPIC_TOOLS = [{"name": "echo", "description": "Repeat the text.", "input_schema": ECHO_PARAMETERS}]


@pytest.fixture(scope="module")
def engine(model, tok):  # noqa: F811
    engine = RecordingEngine(model, tok, max_running_requests=16)
    yield engine
    engine.shutdown()


def serve(engine, tok, talk, parser=None, default=GREEDY):
    """Run `await talk(openai_client, anthropic_client)` against a served endpoint with one open session; returns
    (its result, the session)."""

    async def main():
        endpoint = OpenAIEndpoint(engine, tok, parser or HermesParser(), False, default, None)
        await endpoint.start()
        session = endpoint.open_session()
        base = endpoint.base_url_of(session)
        async with (openai.AsyncOpenAI(base_url=base, api_key=endpoint.api_key, max_retries=0) as client,
                    anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=endpoint.api_key,
                                             max_retries=0) as claude):
            try:
                return await talk(client, claude), session
            finally:
                await endpoint.stop()

    return asyncio.run(main())


def answer(model, tok, ids: list[int]) -> tuple[list[int], str]:  # noqa: F811
    action = greedy(model, ids, N)
    return action, tok.decode(action, skip_special_tokens=True)


def sampled(engine, tok, ids: list[int], seed: int = 11) -> tuple[list[int], str]:
    """The tokens the engine samples after `ids` at SAMPLED with `seed`, and their text."""
    payload = {"input_ids": ids, "sampling_params": SAMPLED | {"sampling_seed": seed}}
    action = asyncio.run(engine.generate(payload))["output_ids"]
    return action, tok.decode(action, skip_special_tokens=True)


def records(session) -> list[list[int]]:
    return [record["input_ids"] for record in session.trajectory.token_sequences()]


# ---- streaming ----


def test_a_streamed_chat_call_is_the_answer_unstreamed_recorded_alike(engine, model, tok):  # noqa: F811
    async def talk(client, _):
        plain = await client.chat.completions.create(model="m", messages=QUESTION, logprobs=True, seed=11)
        stream = await client.chat.completions.create(model="m", messages=QUESTION, logprobs=True, stream=True,
                                                      stream_options={"include_usage": True}, seed=11)
        chunks = [chunk async for chunk in stream]
        async with client.chat.completions.stream(model="m", messages=QUESTION, seed=11) as helper:
            helped = [event.delta async for event in helper if event.type == "content.delta"]
        return plain, chunks, helped

    (plain, chunks, helped), session = serve(engine, tok, talk, default=SAMPLED)
    ids = encode(tok, chat(tok, QUESTION))
    action, text = sampled(engine, tok, ids)
    deltas = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == text == plain.choices[0].message.content
    assert "".join(helped) == text  # the stream helper (whose final completion refuses an answer cut by its length)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert chunks[-1].usage.completion_tokens == N and chunks[-1].usage.prompt_tokens == len(ids)
    logps = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert logps == pytest.approx(token_logps(model, ids + action)[len(ids):], abs=1e-4)
    assert records(session) == [ids + action] * 3  # each call a sequence of its own, streamed or not
    assert session.trajectory.agent_calls == {"chat": 3, "completions": 0, "responses": 0, "messages": 0,
                                              "streamed": 2}


def test_streamed_tool_calls_and_completions_reassemble(engine, model, tok):  # noqa: F811
    async def talk(client, _):
        async with client.chat.completions.stream(model="m", messages=QUESTION, tools=TOOLS) as helper:
            final = await helper.get_final_completion()
        chunks = [c async for c in await client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS,
                                                                        stream=True)]
        completion = [c async for c in await client.completions.create(
            model="m", prompt="Hello there", max_tokens=N, stream=True, stream_options={"include_usage": True})]
        return final, chunks, completion

    (final, chunks, completion), session = serve(engine, tok, talk, parser=EchoCalls())
    _, text = answer(model, tok, encode(tok, render_conversation(tok, QUESTION, TOOLS, EchoCalls(), native=False)))
    [call] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "echo"
    assert json.loads(call.function.arguments) == {"said": text}
    pieces = [c.choices[0].delta.tool_calls[0].function.arguments for c in chunks
              if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 2 and json.loads("".join(pieces)) == {"said": text}
    prompt_ids = encode(tok, "Hello there")
    assert "".join(c.choices[0].text for c in completion if c.choices) == answer(model, tok, prompt_ids)[1]
    assert completion[-1].usage.prompt_tokens == len(prompt_ids) and completion[-1].usage.completion_tokens == N
    assert session.trajectory.agent_calls["streamed"] == 3 and session.trajectory.tool_calls == 2


# ---- OpenAI's Responses API ----


def test_responses_go_on_from_a_previous_response_as_one_sequence(engine, model, tok):  # noqa: F811
    async def talk(client, _):
        first = await client.responses.create(model="m", input="What is 2 + 2?", instructions="Be brief.",
                                              extra_body=SEED)
        stream = await client.responses.create(model="m", input=[{"role": "user", "content": "Go on."}], stream=True,
                                               instructions="Be brief.", previous_response_id=first.id, extra_body=SEED)
        return first, [event async for event in stream]

    (first, events), session = serve(engine, tok, talk, default=SAMPLED)
    ids = encode(tok, chat(tok, SYSTEM + QUESTION))
    first_action, first_text = sampled(engine, tok, ids)
    assert (first.output_text, first.status, first.incomplete_details.reason) == (
        first_text, "incomplete", "max_output_tokens")
    assert (first.usage.input_tokens, first.usage.output_tokens) == (len(ids), N)
    history = SYSTEM + QUESTION + [{"role": "assistant", "content": first_text}, {"role": "user", "content": "Go on."}]
    later = encode(tok, chat(tok, history)[len(chat(tok, SYSTEM + QUESTION) + first_text):])
    continued = ids + first_action + later
    second_action, second_text = sampled(engine, tok, continued)
    assert records(session) == [continued + second_action]
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == second_text == events[-1].response.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_a_responses_tool_call_round_trip_by_previous_response_or_by_items(engine, model, tok):  # noqa: F811
    output = {"type": "function_call_output", "call_id": None, "output": "echoed"}

    async def by_id(client, _):
        first = await client.responses.create(model="m", input=QUESTION, tools=RESPONSE_TOOLS)
        second = await client.responses.create(model="m", input=[output | {"call_id": first.output[0].call_id}],
                                               previous_response_id=first.id, tools=RESPONSE_TOOLS)
        return first, second

    async def by_items(client, _):
        first = await client.responses.create(model="m", input=QUESTION, tools=RESPONSE_TOOLS)
        items = QUESTION + [item.model_dump(exclude_none=True) for item in first.output]
        async with client.responses.stream(model="m", input=items + [output | {"call_id": first.output[0].call_id}],
                                           tools=RESPONSE_TOOLS) as helper:
            return await helper.get_final_response()

    (first, second), session = serve(engine, tok, by_id, parser=EchoCalls())
    streamed, sent_back = serve(engine, tok, by_items, parser=EchoCalls())
    prompt = render_conversation(tok, QUESTION, TOOLS, EchoCalls(), native=False)
    first_action, first_text = answer(model, tok, encode(tok, prompt))
    [call] = first.output  # no text: a function_call item only
    assert (call.type, call.name, json.loads(call.arguments), first.status) == (
        "function_call", "echo", {"said": first_text}, "completed")
    later = render_conversation(tok, QUESTION + [{"role": "assistant", "content": first_text}, {
        "role": "tool", "content": "echoed"}], TOOLS, EchoCalls(), native=False)
    ids = encode(tok, prompt) + first_action + encode(tok, later[len(prompt + first_text):])
    second_action, second_text = answer(model, tok, ids)
    for response, used in ((second, session), (streamed, sent_back)):
        assert json.loads(response.output[0].arguments) == {"said": second_text}
        assert records(used) == [ids + second_action]
        assert used.trajectory.agent_calls["responses"] == 2
    assert sent_back.trajectory.agent_calls["streamed"] == 1


@pytest.mark.parametrize("fields, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"previous_response_id": "resp_elsewhere"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]}, "input[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required", "tools": RESPONSE_TOOLS}, "tool_choice"),
    ({"extra_body": {"stop": ["x"]}}, "stop"),
])
def test_unsupported_responses_fields_are_refused_naming_them(engine, tok, fields, param):
    async def talk(client, _):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="m", **{"input": "Hi"} | fields)
        return caught.value

    error, session = serve(engine, tok, talk)
    assert (error.status_code, error.param) == (400, param) and param.split("[")[0] in error.message
    assert session.calls == 0


# ---- Anthropic's Messages API ----


def test_anthropic_messages_with_stop_sequences_and_streamed(engine, model, tok):  # noqa: F811
    ids = encode(tok, chat(tok, SYSTEM + QUESTION))
    action, text = sampled(engine, tok, ids)
    stop = tok.decode(action[:3])[-len(tok.decode(action[2:3])) - 1:]  # the third token and a character before it
    assert stop not in tok.decode(action[:2])

    async def talk(_, claude):
        fields = {"model": "m", "max_tokens": N, "system": "Be brief.", "messages": QUESTION, "extra_body": SEED}
        plain = await claude.messages.create(**fields)
        stopped = await claude.messages.create(**fields, stop_sequences=[stop])
        async with claude.messages.stream(**fields) as stream:
            pieces = [piece async for piece in stream.text_stream]
            final = await stream.get_final_message()
        return plain, stopped, pieces, final

    (plain, stopped, pieces, final), session = serve(engine, tok, talk, default=SAMPLED)
    assert ([block.text for block in plain.content], plain.stop_reason) == ([text], "max_tokens")
    assert (plain.usage.input_tokens, plain.usage.output_tokens) == (len(ids), N)
    cut = tok.decode(action[:3])
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == (
        cut[: cut.find(stop)], "stop_sequence", stop)
    assert len(pieces) > 1 and "".join(pieces) == text
    assert final.model_dump(exclude={"id"}) == plain.model_dump(exclude={"id"})
    assert records(session) == [ids + action, ids + action[:3], ids + action]
    assert session.trajectory.agent_calls == {"chat": 0, "completions": 0, "responses": 0, "messages": 3,
                                              "streamed": 1}


def test_an_anthropic_tool_use_round_trip_continues_one_sequence(engine, model, tok):  # noqa: F811
    async def talk(_, claude):
        first = await claude.messages.create(model="m", max_tokens=N, messages=QUESTION, tools=ANTHROPIC_TOOLS)
        [use] = first.content
        messages = QUESTION + [{"role": "assistant", "content": first.content}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "echoed"}]}]
        async with claude.messages.stream(model="m", max_tokens=N, messages=messages, tools=ANTHROPIC_TOOLS) as stream:
            return first, await stream.get_final_message()

    (first, second), session = serve(engine, tok, talk, parser=EchoCalls())
    prompt = render_conversation(tok, QUESTION, TOOLS, EchoCalls(), native=False)
    first_action, first_text = answer(model, tok, encode(tok, prompt))
    [use] = first.content
    assert (use.type, use.name, use.input, first.stop_reason) == ("tool_use", "echo", {"said": first_text}, "tool_use")
    later = render_conversation(tok, QUESTION + [{"role": "assistant", "content": first_text}, {
        "role": "tool", "content": "echoed"}], TOOLS, EchoCalls(), native=False)
    ids = encode(tok, prompt) + first_action + encode(tok, later[len(prompt + first_text):])
    second_action, second_text = answer(model, tok, ids)
    assert (second.content[0].input, second.stop_reason) == ({"said": second_text}, "tool_use")
    assert records(session) == [ids + second_action] and session.trajectory.tool_calls == 2


@pytest.mark.parametrize("fields, named", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "messages[0]"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools"),
    ({"messages": QUESTION + [{"role": "assistant", "content": "Four"}]}, "messages[1]"),
    ({"extra_body": {"max_tokens": None}}, "max_tokens is required"),
])
def test_anthropic_errors_come_in_anthropics_shape_naming_the_field(engine, tok, fields, named):
    async def talk(_, claude):
        with pytest.raises(anthropic.BadRequestError) as caught:
            await claude.messages.create(**{"model": "m", "max_tokens": N, "messages": QUESTION} | fields)
        return caught.value

    error, session = serve(engine, tok, talk)
    assert error.status_code == 400 and error.body["type"] == "error"
    assert error.body["error"]["type"] == "invalid_request_error" and named in error.body["error"]["message"]
    assert session.calls == 0


def test_anthropics_client_needs_the_runs_key(engine, tok):
    async def talk(_, claude):
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await claude.with_options(api_key="rl2").messages.create(model="m", max_tokens=N, messages=QUESTION)
        return caught.value

    error, _ = serve(engine, tok, talk)
    assert error.body["error"]["type"] == "authentication_error" and "x-api-key" in error.body["error"]["message"]


# ---- the example agents ----


def test_the_example_agents_run_once_each_and_their_calls_are_counted(engine, tok):
    """envs/tool_use_agent.py (chat), tool_use_responses_agent.py and tool_use_messages_agent.py (streamed), one
    run each: every answer of this format is a call (of a tool they do not have), so each makes its three calls,
    each sending the tool's error back, all one sequence."""
    rows = [{"prompt": QUESTION, "extra_info": {"answer": "4", "corpus": ""}}]

    async def main():
        endpoint = OpenAIEndpoint(engine, tok, EchoCalls(), False, GREEDY, None)
        try:
            return [(await agent_rollout_batch(endpoint, load_agent(REPO / "envs" / f"tool_use{name}_agent.py"), rows,
                                               1, 60.0))[0] for name in ("", "_responses", "_messages")]
        finally:
            await endpoint.stop()

    groups = asyncio.run(main())
    for [trajectory] in groups:
        assert (trajectory.fault, trajectory.n_turns, len(trajectory.sequences)) == (None, 3, 1)
        assert "Error: KeyError: 'echo'" in trajectory.turns[0].env_text
    assert [t.agent_calls for [t] in groups] == [
        {"chat": 3, "completions": 0, "responses": 0, "messages": 0, "streamed": 0},
        {"chat": 0, "completions": 0, "responses": 3, "messages": 0, "streamed": 0},
        {"chat": 0, "completions": 0, "responses": 0, "messages": 3, "streamed": 3}]
    metrics = rollout_metrics(groups, tools=True)
    assert {key: value for key, value in metrics.items() if key.startswith("rollout/agent_calls/")} == {
        "rollout/agent_calls/chat": 1.0, "rollout/agent_calls/completions": 0.0, "rollout/agent_calls/messages": 1.0,
        "rollout/agent_calls/responses": 1.0, "rollout/agent_calls/streamed": 1.0}
