"""Anthropic's Messages API (`POST /v1/messages`) of the endpoint (`RL2.agents.endpoint`), streamed or not: `system`,
the messages' content blocks and `tools` become chat messages and tools, sampled as a chat call (docs/agents.md)."""

import json

from RL2.agents.requests import RequestError, chat_tools, parse_call, show, text_of
from RL2.agents.streaming import pieces

_DEFAULT_ONLY = {
    "thinking": ((None, {"type": "disabled"}), "the chat template decides how the policy reasons"),
    "container": ((None,), "the agent runs its own tools"),
    "mcp_servers": ((None, []), "the agent runs its own tools"),
}
_FIELDS = {"messages", "system", "max_tokens", "stop_sequences", "tools", "tool_choice", "chat_template_kwargs"}


async def messages(endpoint, session, body: dict) -> dict | list:
    call = parse_call(body, "messages", _FIELDS, _DEFAULT_ONLY, ("max_tokens",), stop="stop_sequences")
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens is required (the Messages API has no default); send the most tokens to sample",
                           "max_tokens")
    choice = body.get("tool_choice")
    choice = {"type": choice.get("type")} if isinstance(choice, dict) else choice  # disable_parallel_tool_use: any
    schemas, parsing = chat_tools(body.get("tools"), choice, '{"name": ..., "input_schema": ...}',
                                  lambda t: {"name": t.get("name"), "description": t.get("description"),
                                             "parameters": t.get("input_schema")}
                                  if t.get("type", "custom") == "custom" else None,
                                  (None, {"type": "auto"}, {"type": "none"}))
    system = text_of(body.get("system"), field="system")
    system = [{"role": "system", "content": system}] if system else []
    answer = await endpoint.chat_turn(session, system + _messages(body.get("messages")), schemas, parsing, call)
    [reply] = answer.replies
    content = [{"type": "text", "text": reply.message["content"] or ""}] \
        if reply.message["content"] or not reply.message.get("tool_calls") else []
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in reply.message.get("tool_calls") or []]
    stop = reply.matched if isinstance(reply.matched, str) and reply.matched in call.stops else None
    reason = {"tool_calls": "tool_use", "length": "max_tokens"}.get(reply.finish,
                                                                    "stop_sequence" if stop else "end_turn")
    usage = {"input_tokens": len(answer.prompt.ids), "output_tokens": answer.completion_tokens,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    message = {"id": f"msg_{session.id}_{answer.k}", "type": "message", "role": "assistant", "model": call.model,
               "content": content, "stop_reason": reason, "stop_sequence": stop, "usage": usage}
    if not call.stream:
        return message
    started = message | {"content": [], "stop_reason": None, "stop_sequence": None,
                         "usage": usage | {"output_tokens": 0}}
    events = [("message_start", {"message": started})]
    for index, block in enumerate(content):
        if block["type"] == "text":
            start, deltas = block | {"text": ""}, [{"type": "text_delta", "text": p} for p in pieces(block["text"])]
        else:
            arguments = json.dumps(block["input"], ensure_ascii=False)
            start, deltas = block | {"input": {}}, [{"type": "input_json_delta", "partial_json": p}
                                                    for p in pieces(arguments)]
        events += [("content_block_start", {"index": index, "content_block": start}),
                   *[("content_block_delta", {"index": index, "delta": delta}) for delta in deltas],
                   ("content_block_stop", {"index": index})]
    events += [("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                  "usage": {"output_tokens": answer.completion_tokens}}), ("message_stop", {})]
    return [(name, {"type": name} | data) for name, data in events]


def _messages(messages: object) -> list[dict]:
    """The request's messages as chat messages: a user message's tool_result blocks become tool messages (before
    its text), an assistant message's tool_use blocks its tool calls."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of messages, not {show(messages)}", "messages")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if role else None
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if role not in ("user", "assistant") or not isinstance(blocks, list) or \
                not all(isinstance(block, dict) for block in blocks):
            raise RequestError(f"messages[{i}] must be an object with role user or assistant and content (text or "
                               f"content blocks), not {show(message)}", f"messages[{i}]")
        kinds = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}[role]
        if bad := [block.get("type") for block in blocks if block.get("type") not in kinds]:
            raise RequestError(f"messages[{i}] has a {show(bad[0])} block; a {role} message takes "
                               f"{' and '.join(kinds)} blocks (the policy reads and writes text)",
                               f"messages[{i}].content")
        try:
            text = text_of([block for block in blocks if block["type"] == "text"])
            if role == "assistant":
                calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}
                         for b in blocks if b["type"] == "tool_use"]
                out.append({"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {}))
                continue
            out += [{"role": "tool", "tool_call_id": b["tool_use_id"], "content": text_of(b.get("content"))}
                    for b in blocks if b["type"] == "tool_result"]
        except (KeyError, ValueError) as e:
            raise RequestError(f"messages[{i}].content: a block lacks {e}" if isinstance(e, KeyError) else
                               f"messages[{i}].content: {e}", f"messages[{i}].content") from None
        if text or not any(block["type"] == "tool_result" for block in blocks):
            out.append({"role": "user", "content": text})
    if out[-1]["role"] == "assistant":
        raise RequestError(f"messages[{len(messages) - 1}] is the assistant's: continuing a written answer (prefill) "
                           f"is not served; end with a user message", f"messages[{len(messages) - 1}]")
    return out
