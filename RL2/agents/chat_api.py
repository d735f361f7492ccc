"""OpenAI's chat completions (`POST /v1/chat/completions`), completions (`POST /v1/completions`) and models
(`GET /v1/models`) APIs of the endpoint (`RL2.agents.endpoint`), streamed or not."""

import itertools
import time

from RL2.agents.requests import CHANGES_SAMPLING, MODEL_ID, RequestError, chat_tools, parse_call, show, text_of
from RL2.agents.streaming import pieces

# Fields accepted at these values only (OpenAI's defaults), and why other values are refused.
_DEFAULT_ONLY = {
    "top_logprobs": ((None, 0), "the engine returns the sampled tokens' log-probabilities only; send 0"),
    "presence_penalty": ((0,), CHANGES_SAMPLING),
    "frequency_penalty": ((0,), CHANGES_SAMPLING),
    "logit_bias": ((None, {}), CHANGES_SAMPLING),
    "response_format": ((None, {"type": "text"}), CHANGES_SAMPLING + "; ask for the format in the prompt"),
    "prediction": ((None,), CHANGES_SAMPLING),
    "reasoning_effort": ((None,), "the chat template decides how the policy reasons"),
    "functions": ((None, []), "use tools"),
    "function_call": ((None, "auto", "none"), "use tool_choice 'auto' or 'none'"),
    "modalities": ((None, ["text"]), "the policy writes text only"),
    "audio": ((None,), "the policy writes text only"),
    "web_search_options": ((None,), "the agent runs its own tools"),
}
_COMPLETION_DEFAULT_ONLY = {key: _DEFAULT_ONLY[key] for key in ("presence_penalty", "frequency_penalty",
                                                                  "logit_bias")} | {
    "echo": ((False,), "the prompt is not sent back"),
    "suffix": ((None,), "the policy writes after the prompt only"),
    "best_of": ((None, 1), "use n"),
}
_SAMPLING = {"max_tokens", "stop", "n", "logprobs", "stream_options"}
_CHAT_FIELDS = {"messages", "tools", "tool_choice", "chat_template_kwargs", "max_completion_tokens"} | _SAMPLING
_COMPLETION_FIELDS = {"prompt"} | _SAMPLING
_ROLES = ("system", "developer", "user", "assistant", "tool")


async def chat_completions(endpoint, session, body: dict) -> dict | list:
    call = parse_call(body, "chat", _CHAT_FIELDS, _DEFAULT_ONLY, ("max_completion_tokens", "max_tokens"),
                      logprobs="logprobs")
    usage = _include_usage(body)
    schemas, parsing = chat_tools(body.get("tools"), body.get("tool_choice"), '{"type": "function", "function": '
                                  '{"name": ..., "parameters": ...}}',
                                  lambda tool: tool.get("function") if tool.get("type") == "function" else None)
    answer = await endpoint.chat_turn(session, _messages(body), schemas, parsing, call)
    head = {"id": f"chatcmpl-{session.id}-{answer.k}", "object": "chat.completion", "created": int(time.time()),
            "model": call.model}
    logprobs = [{"content": _token_logprobs(endpoint, reply.turn), "refusal": None} if call.logprobs else None
                for reply in answer.replies]
    if not call.stream:
        choices = [{"index": j, "message": reply.message, "finish_reason": reply.finish, "logprobs": logprobs[j]}
                   for j, reply in enumerate(answer.replies)]
        return head | {"choices": choices, "usage": _usage(answer)}
    head["object"] = "chat.completion.chunk"
    events = []
    for j, reply in enumerate(answer.replies):
        def chunk(delta: dict, finish: str | None = None, logprob: dict | None = None) -> tuple[None, dict]:
            choice = {"index": j, "delta": delta, "logprobs": logprob, "finish_reason": finish}
            return None, head | {"choices": [choice]}

        events.append(chunk({"role": "assistant", "content": ""}, logprob=logprobs[j]))
        events += [chunk({"content": piece}) for piece in pieces(reply.message["content"] or "")]
        for i, tool_call in enumerate(reply.message.get("tool_calls") or []):
            function = tool_call["function"]
            events.append(chunk({"tool_calls": [{"index": i, "id": tool_call["id"], "type": "function",
                                                 "function": {"name": function["name"], "arguments": ""}}]}))
            events += [chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                       for piece in pieces(function["arguments"])]
        events.append(chunk({}, reply.finish))
    return _with_usage(events, head, answer, usage)


async def completions(endpoint, session, body: dict) -> dict | list:
    call = parse_call(body, "completions", _COMPLETION_FIELDS, _COMPLETION_DEFAULT_ONLY, ("max_tokens",))
    logprobs = body.get("logprobs")  # the number of alternatives per token: 0 gives the sampled tokens' only
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs != 0):
        raise RequestError(f"logprobs={show(logprobs)} is not supported: the engine returns the sampled tokens' "
                           f"log-probabilities only; send logprobs=0 (or leave it out)", "logprobs")
    call.logprobs = logprobs is not None
    usage = _include_usage(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(f"prompt must be a non-empty string, not {show(prompt)}; send one prompt per request",
                           "prompt")
    answer = await endpoint.sample(session, prompt, call, "prompt", None)
    choices = []
    for j, reply in enumerate(answer.replies):
        logprobs = None
        if call.logprobs:
            tokens = endpoint.token_strings(reply.turn.action_ids)
            offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=len(prompt)))
            logprobs = {"tokens": tokens, "token_logprobs": reply.turn.action_logps, "top_logprobs": None,
                        "text_offset": offsets if tokens else []}
        choices.append({"index": j, "text": reply.text, "finish_reason": reply.finish, "logprobs": logprobs})
    head = {"id": f"cmpl-{session.id}-{answer.k}", "object": "text_completion", "created": int(time.time()),
            "model": call.model}
    if not call.stream:
        return head | {"choices": choices, "usage": _usage(answer)}
    events = []
    for choice in choices:
        events += [(None, head | {"choices": [{"index": choice["index"], "text": piece, "logprobs": None,
                                               "finish_reason": None}]}) for piece in pieces(choice["text"])]
        events.append((None, head | {"choices": [choice | {"text": ""}]}))
    return _with_usage(events, head, answer, usage)


async def models(endpoint, session, body: dict) -> dict:
    model = {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "rl2"}
    return {"object": "list", "data": [model]}


def _messages(body: dict) -> list[dict]:
    """The request's messages, each content as one string (the chat template's input)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of messages, not {show(messages)}", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise RequestError(f"messages[{i}] must be an object with role {', '.join(_ROLES)}, not {show(message)}",
                               f"messages[{i}]")
        message = {key: value for key, value in message.items() if value is not None}
        if message["role"] == "developer":  # OpenAI's newer name for system
            message["role"] = "system"
        if "content" in message:
            message["content"] = text_of(message["content"], field=f"messages[{i}].content")
        out.append(message)
    return out


def _include_usage(body: dict) -> bool:
    """Whether a streamed answer ends with a chunk of the token usage (`stream_options.include_usage`)."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not set(options) <= {"include_usage", "include_obfuscation"} or \
            not all(isinstance(value, bool) for value in options.values()):
        raise RequestError(f"stream_options={show(options)} is not supported; send {{\"include_usage\": true}} or "
                           f"leave it out", "stream_options")
    return options.get("include_usage", False)


def _with_usage(events: list, head: dict, answer, usage: bool) -> list:
    """A stream's chunks, then its usage chunk if asked for, then its end."""
    return events + ([(None, head | {"choices": [], "usage": _usage(answer)})] if usage else []) + [(None, "[DONE]")]


def _usage(answer) -> dict:
    prompt, completion = len(answer.prompt.ids), answer.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_logprobs(endpoint, turn) -> list[dict]:
    return [{"token": token, "logprob": logp, "bytes": list(token.encode()), "top_logprobs": []}
            for token, logp in zip(endpoint.token_strings(turn.action_ids), turn.action_logps, strict=True)]

