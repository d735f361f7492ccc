"""The formats in which models write tool calls, each model family's as its chat template writes it: parsed out of
an action, and written for calls. `hermes` (alias `qwen`, also RL2's default), `llama3`, `mistral`: docs/agents.md.
"""

import json
import re
from dataclasses import dataclass, field

from RL2.utils.imports import import_file_or_module

QUOTE_CHARS = 60  # how much of a malformed block an error message quotes


@dataclass
class ToolCall:
    """One call of a tool: its name, its arguments by name, and its id ("call_0", "call_1", ... in one action)."""

    name: str
    arguments: dict
    id: str


@dataclass
class ParsedAction:
    """An action split into its text and its tool calls."""

    content: str  # the action with the call blocks removed, stripped
    calls: list[ToolCall] = field(default_factory=list)  # the well-formed calls, in order
    # One message per call block that could not be parsed (bad JSON, no name, ...), quoting its start.
    errors: list[str] = field(default_factory=list)


class ToolCallParser:
    """A tool-call format. Subclasses set `name` and `call_end` (a stop string that ends an action right after a
    call, "</tool_call>"; None where calls end with the end-of-turn token) and define `parse` and `format_calls`."""

    name: str = ""
    call_end: str | None = None

    def parse(self, text: str) -> ParsedAction:
        """Split an action into its text, its calls and the errors of its malformed calls."""
        raise NotImplementedError

    def format_calls(self, calls: list[ToolCall]) -> str:
        """The text a model writes in this format to make `calls`."""
        raise NotImplementedError

    def stop_at_call_end(self, params: dict) -> dict:
        """Sampling `params` with `call_end` among the stop strings: the model's guess of a result is never sampled."""
        if not self.call_end:
            return params
        stops = params.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        return params | {"stop": stops if self.call_end in stops else [*stops, self.call_end]}


class HermesParser(ToolCallParser):
    """Hermes, Qwen2.5 and Qwen3: one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call."""

    name = "hermes"
    call_end = "</tool_call>"
    # An unclosed block at the end is a call whose end tag was cut (a stop string trimmed, or the
    # token budget reached): it counts if what it holds parses.
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedAction:
        found = []
        for block in (match.group(1) for match in self.BLOCK.finditer(text)):
            try:
                found.append(_call(json.loads(block), block, ("arguments", "parameters")))
            except json.JSONDecodeError as e:
                found.append(_error(f"is not valid JSON ({e.msg})", block))
        return _action(self.BLOCK.sub("", text), found)

    def format_calls(self, calls: list[ToolCall]) -> str:
        blocks = (_dumps({"name": c.name, "arguments": c.arguments}) for c in calls)
        return "\n".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)


class Llama3Parser(ToolCallParser):
    """Llama 3.1/3.2/3.3 JSON tool calling: the whole message is `{"name": ..., "parameters": {...}}`, optionally
    after `<|python_tag|>`; several calls are separated by `;`."""

    name = "llama3"
    call_end = None  # the call ends with <|eom_id|>, a stop token
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedAction:
        before, tag, after = text.partition(self.TAG)
        if tag:  # the model said it calls: whatever does not parse is an error
            return _action(before, _json_sequence(after, ";", ("parameters", "arguments")))
        # Bare JSON (also what is left once a decode skips the special <|python_tag|>): calls only when the
        # whole message parses as calls, so that prose, or JSON given as an answer, stays content.
        found = _json_sequence(text, ";", ("parameters", "arguments"))
        if found and not any(isinstance(item, str) for item in found):
            return _action("", found)
        return ParsedAction(text.strip())

    def format_calls(self, calls: list[ToolCall]) -> str:
        # As Llama 3.1's template renders an assistant's tool calls (without <|python_tag|>).
        return "; ".join(_dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or newer templates' `[TOOL_CALLS]name[ARGS]{...}`."""

    name = "mistral"
    call_end = None  # the call ends with </s>, the end-of-sequence token
    TAG = "[TOOL_CALLS]"
    # Newer templates: name, an optional call id, then the arguments.
    NAMED = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?\[ARGS\]")
    # Mistral's templates refuse any call id but 9 letters and digits ("call00000", "call00001", ...).
    IDS = "call{:05d}"

    def parse(self, text: str) -> ParsedAction:
        segments = text.split(self.TAG)
        if len(segments) == 1:
            # [TOOL_CALLS] is a special token, which a decode that skips them drops: a message that is
            # just a JSON list of calls is taken as calls, anything else as content.
            stripped = text.strip()
            if stripped.startswith("["):
                found, rest = _json_list(stripped, 0)
                if found and not rest.strip() and not any(isinstance(item, str) for item in found):
                    return _action("", found, self.IDS)
            return ParsedAction(stripped)
        found, content = [], [segments[0]]
        for segment in segments[1:]:
            calls, rest = self._segment(segment)
            found += calls
            content.append(rest)
        return _action("".join(content), found, self.IDS)

    def format_calls(self, calls: list[ToolCall]) -> str:
        if not calls:
            return ""
        return self.TAG + _dumps([{"name": c.name, "arguments": c.arguments} for c in calls])

    def _segment(self, segment: str) -> tuple[list, str]:
        """The calls of the text after one [TOOL_CALLS], and the text after them."""
        start = len(segment) - len(segment.lstrip())
        if segment.startswith("[", start):
            return _json_list(segment, start)
        named = self.NAMED.match(segment)
        if named is None:
            return [_error("is neither a JSON list of calls nor name[ARGS]{...}", segment)], ""
        try:
            arguments, end = _DECODER.raw_decode(segment, named.end())
        except json.JSONDecodeError as e:
            return [_error(f"has arguments that are not valid JSON ({e.msg})", segment)], ""
        return [_call({"name": named.group(1), "arguments": arguments}, segment[:end], ("arguments",))], segment[end:]


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")

# The formats by name: the help of rollout.tool_parser (RL2/config/ppo_schema.py) lists them (test_registries.py).
_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}


def register_tool_parser(name: str, parser_cls: type[ToolCallParser]) -> None:
    """Make `parser_cls`, a `ToolCallParser` subclass made with no arguments, `tool_call_parser(name, ...)`."""
    if not (isinstance(parser_cls, type) and issubclass(parser_cls, ToolCallParser)):
        raise ValueError(f"tool-call parser {name!r}: {parser_cls!r} is not a subclass of "
                         f"RL2.rollout.tools.tool_calls.ToolCallParser; subclass it and define parse and format_calls")
    _PARSERS[name] = parser_cls


def tool_call_parser(spec: str, tokenizer) -> ToolCallParser:
    """The parser `spec` names: "auto" (the format the tokenizer's chat template writes), a registered name, or
    "path/to/file.py:ClassName" / "package.module:ClassName" naming a `ToolCallParser` subclass."""
    if spec == "auto":
        return _PARSERS[_detect(getattr(tokenizer, "chat_template", None))]()
    if spec in _PARSERS:
        return _PARSERS[spec]()
    if ":" not in spec:
        raise ValueError(f"tool-call parser {spec!r} is unknown; {_choices()}")
    where, _, class_name = spec.rpartition(":")
    try:
        module = import_file_or_module(where, "rl2_tool_parser_")
    except FileNotFoundError as e:
        raise ValueError(f"tool-call parser {spec!r}: {e}; {_choices()}") from None
    except ImportError as e:
        raise ValueError(f"tool-call parser {spec!r}: cannot import {where} ({e}); {_choices()}") from None
    parser_cls = getattr(module, class_name, None)
    if not (isinstance(parser_cls, type) and issubclass(parser_cls, ToolCallParser)):
        raise ValueError(f"tool-call parser {spec!r}: {where} defines no ToolCallParser subclass named "
                         f"{class_name!r}; {_choices()}")
    return parser_cls()


def _detect(chat_template: str | dict | None) -> str:
    """The format a chat template writes tool calls in; Hermes, RL2's default, for templates that know no tools."""
    if isinstance(chat_template, dict):  # named templates ("default", "tool_use", ...)
        chat_template = "\n".join(chat_template.values())
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def _choices() -> str:
    return (f"choose auto, one of {', '.join(sorted(_PARSERS))}, or path/to/file.py:ClassName / "
            f"package.module:ClassName naming a subclass of RL2.rollout.tools.tool_calls.ToolCallParser")


def _call(obj: object, block: str, argument_keys: tuple[str, ...]) -> tuple[str, dict] | str:
    """The call a decoded JSON value describes: a name and an object of arguments. `block` is the text it was
    decoded from (the error quotes it); `argument_keys` may hold the arguments, in order (none: no arguments)."""
    if not isinstance(obj, dict):
        return _error(f"is a JSON {_json_type(obj)}, not an object with a name and arguments", block)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _error("has no name", block)
    arguments = next((obj[key] for key in argument_keys if key in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return _error("has arguments that are a string but not JSON", block)
    if not isinstance(arguments, dict):
        return _error(f"has arguments that are a JSON {_json_type(arguments)}, not an object", block)
    return name, arguments


def _json_sequence(text: str, separator: str, argument_keys: tuple[str, ...]) -> list[tuple[str, dict] | str]:
    """The calls of JSON objects written one after another, `separator` between them."""
    found, pos = [], _SPACE.match(text, 0).end()
    while pos < len(text):
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            found.append(_error(f"is not valid JSON ({e.msg})", text[pos:]))
            break
        found.append(_call(obj, text[pos:end], argument_keys))
        pos = _SPACE.match(text, end).end()
        if pos < len(text):
            if text[pos] != separator:
                found.append(_error(f"follows a call without a {separator!r} between them", text[pos:]))
                break
            pos = _SPACE.match(text, pos + 1).end()
    return found


def _json_list(text: str, start: int) -> tuple[list[tuple[str, dict] | str], str]:
    """The calls of a JSON list of call objects at `start`, and the text after the list."""
    try:
        items, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as e:
        return [_error(f"is not valid JSON ({e.msg})", text[start:])], ""
    if not isinstance(items, list):
        return [_error(f"is a JSON {_json_type(items)}, not a list of calls", text[start:end])], text[end:]
    return [_call(item, _dumps(item), ("arguments", "parameters")) for item in items], text[end:]


def _action(content: str, found: list[tuple[str, dict] | str], ids: str = "call_{}") -> ParsedAction:
    """`content` with the calls read, each (name, arguments), numbered in `ids`, or an error message."""
    calls = [ToolCall(name, arguments, ids.format(i))
             for i, (name, arguments) in enumerate(item for item in found if not isinstance(item, str))]
    return ParsedAction(content.strip(), calls, [item for item in found if isinstance(item, str)])


def _error(problem: str, block: str) -> str:
    block = block.strip()
    quoted = block[:QUOTE_CHARS] + ("..." if len(block) > QUOTE_CHARS else "")
    return f"tool call {problem}: {quoted}"


def _json_type(value: object) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _dumps(value: object) -> str:
    # As chat templates' tojson writes it: non-ASCII characters as they are.
    return json.dumps(value, ensure_ascii=False)
