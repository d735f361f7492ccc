"""Tool-call formats: parsing hand-written actions of each family, writing calls, choosing the parser."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from RL2.rollout.tools import tool_calls
from RL2.rollout.tools.tool_calls import (
    HermesParser,
    Llama3Parser,
    MistralParser,
    ParsedAction,
    ToolCall,
    ToolCallParser,
    register_tool_parser,
    tool_call_parser,
)

CHOICES = "choose auto, one of hermes, llama3, mistral, qwen, or path/to/file.py:ClassName"


# ---- Hermes / Qwen ----


def test_hermes_two_calls_and_text_around_them():
    text = (
        "I will add, then multiply.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4.5}}\n</tool_call>'
        " Done."
    )
    assert HermesParser().parse(text) == ParsedAction(
        content="I will add, then multiply.\n\n Done.",
        calls=[ToolCall("add", {"a": 1, "b": 2}, "call_0"), ToolCall("mul", {"a": 3, "b": 4.5}, "call_1")],
        errors=[],
    )


def test_hermes_malformed_blocks_are_errors_not_calls():
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
        '<tool_call>{"arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
        '<tool_call>["add"]</tool_call>'
        '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
        "tail"
    )
    parsed = HermesParser().parse(text)
    assert parsed.calls == [ToolCall("ok", {}, "call_0")]  # ids count the calls, not the blocks
    assert parsed.content == "tail"
    assert parsed.errors == [
        "tool call is not valid JSON (Expecting property name enclosed in double quotes): "
        '{"name": "add", "arguments": {"a": 1,}}',
        'tool call has no name: {"arguments": {"a": 1}}',
        'tool call has arguments that are a JSON array, not an object: {"name": "add", "arguments": [1, 2]}',
        'tool call is a JSON array, not an object with a name and arguments: ["add"]',
    ]


def test_hermes_error_quotes_only_the_start_of_a_long_block():
    block = '{"name": "write", "arguments": {"text": "' + "x" * 100 + '"'  # unterminated
    (error,) = HermesParser().parse(f"<tool_call>{block}</tool_call>").errors
    # 60 characters: the 41 before the text, then 19 of its x's.
    assert error == ("tool call is not valid JSON (Expecting ',' delimiter): "
                     '{"name": "write", "arguments": {"text": "' + "x" * 19 + "...")


def test_hermes_string_arguments_missing_arguments_and_an_unclosed_last_block():
    text = (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
        '<tool_call>{"name": "bad", "arguments": "a=1"}</tool_call>'
        '<tool_call>\n{"name": "mul", "arguments": {"a": 2}}\n'  # the stop string was trimmed
    )
    parsed = HermesParser().parse(text)
    assert parsed.calls == [
        ToolCall("add", {"a": 1}, "call_0"),
        ToolCall("now", {}, "call_1"),
        ToolCall("mul", {"a": 2}, "call_2"),
    ]
    assert parsed.errors == [
        'tool call has arguments that are a string but not JSON: {"name": "bad", "arguments": "a=1"}'
    ]
    assert parsed.content == ""


def test_hermes_plain_text_has_no_calls():
    assert HermesParser().parse("  The answer is 42.\n") == ParsedAction("The answer is 42.", [], [])


def test_hermes_format_calls():
    calls = [ToolCall("add", {"a": 1, "b": 2}, "call_0"), ToolCall("greet", {"who": "Zoë"}, "call_1")]
    text = HermesParser().format_calls(calls)
    assert text == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "greet", "arguments": {"who": "Zoë"}}\n</tool_call>'
    )
    assert HermesParser().parse(text) == ParsedAction("", calls, [])
    assert HermesParser.call_end == "</tool_call>"


# ---- Llama 3 ----


def test_llama3_python_tag_and_bare_json():
    parser = Llama3Parser()
    assert parser.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1}}') == ParsedAction(
        "", [ToolCall("add", {"a": 1}, "call_0")], []
    )
    # Several calls, ";" inside a string argument is not a separator; "arguments" is read too.
    bare = ' {"name": "say", "parameters": {"text": "a; b"}}; {"name": "add", "arguments": {"a": 2}} '
    assert parser.parse(bare) == ParsedAction(
        "", [ToolCall("say", {"text": "a; b"}, "call_0"), ToolCall("add", {"a": 2}, "call_1")], []
    )


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        '{"answer": 42}',  # JSON, but not a call
        '{"name": "add", "parameters": {"a": 1}} and that is my call',
        '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {',
        "",
    ],
)
def test_llama3_bare_text_that_is_not_all_calls_is_content(text):
    assert Llama3Parser().parse(text) == ParsedAction(text.strip(), [], [])


def test_llama3_after_python_tag_a_bad_call_is_an_error():
    parsed = Llama3Parser().parse('Let me look.<|python_tag|>{"name": "add", "parameters": {"a": 1}; {"name": 3}')
    assert parsed == ParsedAction(
        "Let me look.",
        [],
        ["tool call is not valid JSON (Expecting ',' delimiter): "
         '{"name": "add", "parameters": {"a": 1}; {"name": 3}'],
    )
    parsed = Llama3Parser().parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": 3}')
    assert parsed.calls == [ToolCall("a", {}, "call_0")]
    assert parsed.errors == ['tool call has no name: {"name": 3}']


def test_llama3_format_calls():
    calls = [ToolCall("add", {"a": 1}, "call_0"), ToolCall("mul", {"b": 2}, "call_1")]
    text = Llama3Parser().format_calls(calls)
    assert text == '{"name": "add", "parameters": {"a": 1}}; {"name": "mul", "parameters": {"b": 2}}'
    assert Llama3Parser().parse(text).calls == calls
    assert Llama3Parser.call_end is None


# ---- Mistral ----


def test_mistral_json_list():
    text = 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "mul", "arguments": "{\\"b\\": 2}"}]'
    assert MistralParser().parse(text) == ParsedAction(
        "Sure.", [ToolCall("add", {"a": 1}, "call00000"), ToolCall("mul", {"b": 2}, "call00001")], []
    )


def test_mistral_name_args_form():
    text = '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris"}'
    assert MistralParser().parse(text) == ParsedAction(
        "", [ToolCall("add", {"a": 1}, "call00000"), ToolCall("get_weather", {"city": "Paris"}, "call00001")], []
    )


def test_mistral_errors_and_bare_text():
    parser = MistralParser()
    assert parser.parse('[TOOL_CALLS][{"name": "add", "arguments": {"a": }}]').errors == [
        'tool call is not valid JSON (Expecting value): [{"name": "add", "arguments": {"a": }}]'
    ]
    assert parser.parse('[TOOL_CALLS]add[ARGS]{"a": 1').errors == [
        "tool call has arguments that are not valid JSON (Expecting ',' delimiter): add[ARGS]{\"a\": 1"
    ]
    assert parser.parse("[TOOL_CALLS]just words").errors == [
        "tool call is neither a JSON list of calls nor name[ARGS]{...}: just words"
    ]
    assert parser.parse('[TOOL_CALLS][{"arguments": {}}]').errors == ['tool call has no name: {"arguments": {}}']
    # The special [TOOL_CALLS] token dropped by a decode: a bare list of calls is still calls, other text is not.
    assert parser.parse(' [{"name": "add", "arguments": {"a": 1}}]').calls == [ToolCall("add", {"a": 1}, "call00000")]
    assert parser.parse("[1, 2] are the numbers") == ParsedAction("[1, 2] are the numbers", [], [])
    assert parser.parse("[1, 2]") == ParsedAction("[1, 2]", [], [])


def test_mistral_call_ids_are_the_nine_characters_its_templates_demand():
    """Mistral's templates raise on any other id; Mistral Nemo's renders a parsed action's calls and results."""
    from tests.helpers.tiny import tokenizer

    tok = tokenizer()
    tok.chat_template = (Path(__file__).parent.parent / "data" / "chat_templates" / "mistral-nemo.jinja").read_text()
    [call] = MistralParser().parse('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]').calls
    assert len(call.id) == 9 and call.id.isalnum()
    messages = [{"role": "user", "content": "Add."},
                {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function",
                                                      "function": {"name": "add", "arguments": {"a": 1}}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "1"}]
    assert f'"call_id": "{call.id}"' in tok.apply_chat_template(messages, tokenize=False)


def test_mistral_format_calls():
    calls = [ToolCall("add", {"a": 1}, "call00000"), ToolCall("mul", {"b": 2}, "call00001")]
    text = MistralParser().format_calls(calls)
    assert text == '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "mul", "arguments": {"b": 2}}]'
    assert MistralParser().parse(text).calls == calls


# ---- choosing the parser ----

QWEN_LIKE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n...</tool_call>"
MISTRAL_LIKE = "{% if message.tool_calls %}[TOOL_CALLS][{% endif %}"
LLAMA_31_LIKE = "{%- if message.role == 'ipython' or message.role == 'tool' %}<|start_header_id|>ipython"
LLAMA_PYTHON_TAG = "{{- '<|python_tag|>' + tool_call.name }}"


@pytest.mark.parametrize(
    "template, parser_cls",
    [
        (QWEN_LIKE, HermesParser),
        (MISTRAL_LIKE, MistralParser),
        (LLAMA_31_LIKE, Llama3Parser),
        (LLAMA_PYTHON_TAG, Llama3Parser),
        ("{{ messages[0]['content'] }}", HermesParser),  # no tools: RL2's default format
        (None, HermesParser),
        ({"default": "plain", "tool_use": MISTRAL_LIKE}, MistralParser),
    ],
)
def test_auto_detects_the_format_of_the_chat_template(template, parser_cls):
    assert type(tool_call_parser("auto", SimpleNamespace(chat_template=template))) is parser_cls


def test_auto_on_the_default_models_chatml_template_is_hermes(tok):
    assert type(tool_call_parser("auto", tok)) is HermesParser


def test_parsers_by_name():
    assert [type(tool_call_parser(name, None)) for name in ("hermes", "qwen", "llama3", "mistral")] == [
        HermesParser, HermesParser, Llama3Parser, MistralParser
    ]


class Bracketed(ToolCallParser):
    """A user's format for the tests: `{{name}}` with no arguments."""

    name = "bracketed"

    def parse(self, text):
        return ParsedAction("", [ToolCall(text.strip("{}"), {}, "call_0")], [])

    def format_calls(self, calls):
        return "".join("{{" + c.name + "}}" for c in calls)


def test_user_parser_from_a_file_a_module_and_the_registry(tmp_path, monkeypatch):
    file = tmp_path / "my_format.py"
    file.write_text(
        "from RL2.rollout.tools.tool_calls import HermesParser\n\n"
        "class Tagged(HermesParser):\n"
        "    name = 'tagged'\n"
    )
    parser = tool_call_parser(f"{file}:Tagged", None)
    assert isinstance(parser, HermesParser) and parser.name == "tagged"
    assert type(tool_call_parser("tests.unit.test_tool_calls:Bracketed", None)) is Bracketed

    monkeypatch.setattr(tool_calls, "_PARSERS", dict(tool_calls._PARSERS))
    register_tool_parser("bracketed", Bracketed)
    assert tool_call_parser("bracketed", None).parse("{{now}}").calls == [ToolCall("now", {}, "call_0")]
    with pytest.raises(ValueError, match="not a subclass of RL2.rollout.tools.tool_calls.ToolCallParser"):
        register_tool_parser("bad", dict)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("hermes3", "tool-call parser 'hermes3' is unknown; "),
        ("no/such/file.py:Parser", "tool-call parser 'no/such/file.py:Parser': no/such/file.py does not exist; "),
        ("no_such_package.mod:Parser",
         "tool-call parser 'no_such_package.mod:Parser': cannot import no_such_package.mod"),
        ("RL2.rollout.tools.tool_calls:Nope",
         "tool-call parser 'RL2.rollout.tools.tool_calls:Nope': RL2.rollout.tools.tool_calls defines no "
         "ToolCallParser subclass named 'Nope'; "),
        ("RL2.rollout.tools.tool_calls:ToolCall", "defines no ToolCallParser subclass named 'ToolCall'"),
    ],
)
def test_bad_specs_name_the_spec_and_the_choices(spec, message):
    with pytest.raises(ValueError) as raised:
        tool_call_parser(spec, None)
    assert message in str(raised.value) and CHOICES in str(raised.value)
