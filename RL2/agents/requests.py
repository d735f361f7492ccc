"""Checking the endpoint's requests, for every API it serves: the sampling fields (`Call`), tools, content. Fields
the engine does not implement, or the endpoint does not know, are refused with HTTP 400 naming the field rather than
ignored: the policy trained would not be the one the agent asked for."""

import json
import math
from dataclasses import dataclass

from aiohttp import web

# The model id `models.list()` shows; requests may name any model.
MODEL_ID = "rl2-policy"
# OpenAI's limit on choices per request; each is an engine request.
MAX_CHOICES = 128
# Stop strings of one request, and characters of each (OpenAI takes up to 4).
MAX_STOPS = 16
MAX_STOP_CHARS = 256

CHANGES_SAMPLING = ("would change how the policy samples, which RL2's engine does not do (the trainer trains on "
                    "what the policy samples as it is)")
# Fields that change nothing here (bookkeeping of the provider's service).
IGNORED = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
           "prompt_cache_key"}
# Sampling fields every API takes under these names (besides its own for max tokens and stops).
SAMPLING = {"temperature", "top_p", "top_k", "min_p", "seed", "stream"}
# apply_chat_template's own parameters, which a request's chat_template_kwargs may not set.
_TEMPLATE_OWN = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                 "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                 "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class RequestError(Exception):
    """A request the endpoint refuses, answered in its API's error shape: `message` says what is wrong and what
    to send instead, `param` names the request field at fault, `code` is OpenAI's code for it, if any; with
    `close`, the connection is closed after the answer (the rest of the request is not waited for)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 close: bool = False):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.close = message, param, status, code, close

    def response(self, anthropic: bool = False) -> web.Response:
        if anthropic:  # Anthropic's shape: no param (the message names the field)
            kinds = {401: "authentication_error", 404: "not_found_error", 408: "timeout_error"}
            kind = kinds.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
            body = {"type": "error", "error": {"type": kind, "message": self.message}}
        else:
            kind = "invalid_request_error" if self.status < 500 else "server_error"
            body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        response = web.json_response(body, status=self.status)
        if self.close:
            response.force_close()
        return response


@dataclass
class Call:
    """A request's sampling (and chat template variables), checked."""

    api: str  # which API it came through: chat, completions, responses, messages
    params: dict  # the SGLang sampling params the request sets, over the run's defaults
    stops: list[str]  # cut from the text it gets back, as OpenAI does
    n: int = 1  # choices, each one engine request
    logprobs: bool = False
    seed: int | None = None  # the request's own seed (else the session's, if any)
    model: str = MODEL_ID  # the model the request named, echoed back
    stream: bool = False  # answered as server-sent events
    template_kwargs: dict | None = None  # `chat_template_kwargs`


def parse_call(body: dict, api: str, fields: set[str], default_only: dict, max_tokens: tuple[str, ...],
               stop: str = "stop", logprobs: str | None = None) -> Call:
    """A request's sampling fields, checked; fields other than the API's own `fields`, `SAMPLING`, `IGNORED` and
    `default_only`'s, and unsupported values, are refused. `max_tokens`: the request's fields for it (the first
    given counts), `stop`, `logprobs`: its fields for those."""
    known = fields | SAMPLING | IGNORED | set(default_only)
    for key in body:
        if key not in known:
            raise RequestError(f"unknown field {key!r}; RL2's endpoint takes {', '.join(sorted(known))}", key)
    for key, (accepted, why) in default_only.items():
        value = body.get(key)
        if value is not None and value not in accepted:
            raise RequestError(f"{key}={show(value)} is not supported: {why}; or leave {key} out", key)
    bounds = {"temperature": (0.0, None, False), "top_p": (0.0, 1.0, False), "min_p": (0.0, 1.0, False),
              "top_k": (-1, None, True)}  # low, high, integer
    params = {key: value for key, bound in bounds.items() if (value := number(body, key, *bound)) is not None}
    if params.get("top_p") == 0:
        raise RequestError("top_p=0 keeps no token; give a value in (0, 1]", "top_p")
    key = next((key for key in max_tokens if body.get(key) is not None), max_tokens[-1])
    if (most := number(body, key, 1, None, True)) is not None:
        params["max_new_tokens"] = most
    stops = stop_strings(body.get(stop), stop)
    if body.get(stop) is not None:
        params["stop"] = stops
    for key in ("stream", logprobs):
        if key and body.get(key) is not None and not isinstance(body[key], bool):
            raise RequestError(f"{key} must be true or false, not {show(body[key])}", key)
    n = number(body, "n", 1, MAX_CHOICES, True)
    model = body.get("model")
    return Call(api, params, stops, 1 if n is None else n, bool(logprobs and body.get(logprobs)),
                number(body, "seed", None, None, True), model if isinstance(model, str) else MODEL_ID,
                bool(body.get("stream")), template_kwargs(body.get("chat_template_kwargs")))


def number(body: dict, key: str, low: float | None, high: float | None, integer: bool) -> float | int | None:
    value = body.get(key)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        raise RequestError(f"{key}={show(value)} is not {'an integer' if integer else 'a number'}", key)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise RequestError(f"{key}={value} must be {bounds}", key)
    return value


def stop_strings(stop: object, key: str = "stop") -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if stop is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"{key} must be a non-empty string or a list of them, not {show(stop)}", key)
    if len(stops) > MAX_STOPS:
        raise RequestError(f"{key} has {len(stops)} strings; send at most {MAX_STOPS}", key)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"{key} has a string of {max(map(len, stops))} characters; each may have at most "
                           f"{MAX_STOP_CHARS}", key)
    return stops


def template_kwargs(value) -> dict:
    """A request's `chat_template_kwargs` (as vLLM and SGLang take them, e.g. {"enable_thinking": false}):
    variables of the chat template, checked."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise RequestError(f"chat_template_kwargs must be an object of the template's variables, not {show(value)}",
                           "chat_template_kwargs")
    if own := sorted(_TEMPLATE_OWN & set(value)):
        raise RequestError(f"chat_template_kwargs sets {', '.join(own)}, which the endpoint sets itself; pass only "
                           f"the template's own variables (e.g. enable_thinking)", "chat_template_kwargs")
    return value


def chat_tools(tools: object, choice: object, shape: str, schema_of,
               accepted: tuple = (None, "auto", "none")) -> tuple[list[dict] | None, bool]:
    """A request's `tools` as OpenAI chat schemas (None without tools), and whether its `tool_choice` (one of
    `accepted`: its API's 'auto' (or None) first, 'none' last) lets the answer's calls be parsed. `schema_of(tool)`
    gives a tool's {"name", "description", "parameters"}, or None where it is not of the API's function `shape`."""
    schemas = None
    if tools:
        tools = tools if isinstance(tools, list) else [None]
        schemas = [schema_of(tool) if isinstance(tool, dict) else None for tool in tools]
        if not all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in schemas):
            raise RequestError(f"tools must be a list of {shape}; other kinds of tools are not served (the agent runs "
                               f"its own tools)", "tools")
        schemas = [{"type": "function", "function": {k: v for k, v in s.items() if v is not None}} for s in schemas]
    if choice not in accepted:
        raise RequestError(f"tool_choice={show(choice)} is not supported: the policy is sampled as it is, and nothing "
                           f"forces it to call a tool; send {show(accepted[1])} (or {show(accepted[-1])}) and check "
                           f"its answer", "tool_choice")
    return schemas, choice != accepted[-1] and schemas is not None


def text_of(content: object, parts: tuple[str, ...] = ("text",), field: str | None = None) -> str:
    """A message's content as text: a string, or a list of text parts (of the types `parts`) joined. Else a
    ValueError, or with `field` (the request's field of `content`) a `RequestError` naming it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in parts
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    problem = (f"{show(content)} is neither a string nor a list of {' or '.join(parts)} parts; the policy reads "
               f"text only")
    raise RequestError(f"{field}: {problem}", field) if field else ValueError(problem)


def deeper_than(value: object, limit: int) -> bool:
    """Whether JSON `value` nests lists and objects more than `limit` deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return False


def show(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
