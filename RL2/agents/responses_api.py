"""OpenAI's Responses API (`POST /v1/responses`) of the endpoint (`RL2.agents.endpoint`), streamed or not: `input`,
`instructions` and function `tools` become chat messages and tools, sampled as a chat call (docs/agents.md)."""

import time

from RL2.agents.requests import CHANGES_SAMPLING, RequestError, chat_tools, parse_call, show, text_of
from RL2.agents.streaming import pieces

_DEFAULT_ONLY = {
    "top_logprobs": ((None, 0), "the engine returns the sampled tokens' log-probabilities only; send 0"),
    "text": ((None, {"format": {"type": "text"}}), CHANGES_SAMPLING + "; ask for the format in the prompt"),
    "reasoning": ((None,), "the chat template decides how the policy reasons"),
    "include": ((None, []), "the response holds its output only"),
    "truncation": ((None, "disabled"), "a conversation too long for rollout.max_total_tokens is refused"),
    "background": ((None, False), "a response is answered when it is sampled"),
    "prompt": ((None,), "send the prompt's text as input"),
    "conversation": ((None,), "use previous_response_id"),
}
_FIELDS = {"input", "instructions", "tools", "tool_choice", "previous_response_id", "max_output_tokens",
           "chat_template_kwargs", "stream_options"}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT = ("input_text", "output_text", "text")


async def responses(endpoint, session, body: dict) -> dict | list:
    call = parse_call(body, "responses", _FIELDS, _DEFAULT_ONLY, ("max_output_tokens",))
    schemas, parsing = chat_tools(body.get("tools"), body.get("tool_choice"),
                                  '{"type": "function", "name": ..., "parameters": ...}',
                                  lambda t: {key: t.get(key) for key in ("name", "description", "parameters")}
                                  if t.get("type") == "function" else None)
    conversation = _conversation(body, session)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError(f"instructions must be a string, not {show(instructions)}", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    answer = await endpoint.chat_turn(session, system + conversation, schemas, parsing, call, "input")
    [reply] = answer.replies
    response_id = f"resp_{session.id}_{answer.k}"
    session.responses[response_id] = conversation + [reply.message]
    output = _output(reply.message, response_id)
    prompt = len(answer.prompt.ids)
    response = {
        "id": response_id, "object": "response", "created_at": time.time(), "model": call.model, "error": None,
        "status": "incomplete" if reply.finish == "length" else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if reply.finish == "length" else None,
        "instructions": instructions, "previous_response_id": body.get("previous_response_id"),
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "metadata": body.get("metadata") or {}, "output": output,
        "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": answer.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt + answer.completion_tokens},
    }
    if not call.stream:
        return response
    started = response | {"status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    events = [("response.created", {"response": started}), ("response.in_progress", {"response": started})]
    for index, item in enumerate(output):
        events += _item_events(index, item)
    events.append((f"response.{response['status']}", {"response": response}))
    return [(name, {"type": name, "sequence_number": i} | data) for i, (name, data) in enumerate(events)]


def _conversation(body: dict, session) -> list[dict]:
    """The conversation of a request as chat messages: the previous response's, if any, then its input's."""
    previous = body.get("previous_response_id")
    if previous is not None and previous not in session.responses:
        raise RequestError(f"previous_response_id {show(previous)} is no response of this session; the endpoint keeps "
                           f"the responses of the run's own session only", "previous_response_id")
    out = list(session.responses.get(previous, []))
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(items, list) or not (items or out):
        raise RequestError(f"input must be a string or a non-empty list of items, not {show(items)}", "input")
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        try:
            if kind == "message" and item.get("role") in _ROLES:
                out.append({"role": _ROLES[item["role"]], "content": text_of(item.get("content"), _TEXT)})
            elif kind == "function_call":
                tool_call = {"id": item["call_id"], "type": "function",
                             "function": {"name": item["name"], "arguments": item["arguments"]}}
                if not (out and out[-1]["role"] == "assistant"):  # the calls of one answer make one message
                    out.append({"role": "assistant", "content": None})
                out[-1]["tool_calls"] = [*out[-1].get("tool_calls", []), tool_call]
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item["call_id"],
                            "content": text_of(item["output"], _TEXT)})
            else:
                raise ValueError(f"{show(item)} is not a message (role user, system, developer or assistant), "
                                 f"function_call or function_call_output item")
        except KeyError as e:
            raise RequestError(f"input[{i}], a {kind} item, has no {e}", f"input[{i}]") from None
        except ValueError as e:
            raise RequestError(f"input[{i}]: {e}", f"input[{i}]") from None
    return out


def _output(message: dict, response_id: str) -> list[dict]:
    """A response's output items: a message of its text (if any, or if it made no call), then its calls."""
    calls = message.get("tool_calls") or []
    items = []
    if message["content"] or not calls:
        part = {"type": "output_text", "text": message["content"] or "", "annotations": [], "logprobs": []}
        items.append({"type": "message", "id": f"msg_{response_id}", "status": "completed", "role": "assistant",
                      "content": [part]})
    items += [{"type": "function_call", "id": f"fc_{c['id']}", "call_id": c["id"], "name": c["function"]["name"],
               "arguments": c["function"]["arguments"], "status": "completed"} for c in calls]
    return items


def _item_events(index: int, item: dict) -> list[tuple[str, dict]]:
    """The stream events of one output item: added, its deltas, done."""
    at = {"output_index": index, "item_id": item["id"]}
    if item["type"] == "function_call":
        return [("response.output_item.added", {"output_index": index, "item": item | {"arguments": "",
                                                                                       "status": "in_progress"}}),
                *[("response.function_call_arguments.delta", at | {"delta": p}) for p in pieces(item["arguments"])],
                ("response.function_call_arguments.done", at | {"name": item["name"], "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": index, "item": item})]
    [part] = item["content"]
    at |= {"content_index": 0}
    return [("response.output_item.added", {"output_index": index, "item": item | {"content": [],
                                                                                   "status": "in_progress"}}),
            ("response.content_part.added", at | {"part": part | {"text": ""}}),
            *[("response.output_text.delta", at | {"delta": p, "logprobs": []}) for p in pieces(part["text"])],
            ("response.output_text.done", at | {"text": part["text"], "logprobs": []}),
            ("response.content_part.done", at | {"part": part}),
            ("response.output_item.done", {"output_index": index, "item": item})]
