"""Rows -> tokenized examples `{"input_ids": list[int], "loss_mask": list[int]}` (`loss_mask[i] == 1` on the
tokens the model is trained to produce), validating every row on the way (docs/data.md).
"""

import json
import math
from collections.abc import Callable, Iterable

from RL2.datasets.loading import BadRow, DataError
from RL2.utils.tokens import longest_token_chars


def is_missing(value: object) -> bool:
    """None, or the NaN that typed columns (pandas, parquet floats) use for an empty cell."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def as_text(value: object, where: str) -> str:
    """A text cell as a string; a number written where text belongs (`"response": 46` in JSON) is that text, a
    whole float as an integer (a JSON column holding 46 and 4.5 is loaded as floats: its 46 reads "46")."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise BadRow(f"{where} should be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadRow(f"{where} is empty")
    return value


def require_text(row: dict, key: str) -> str:
    if is_missing(row.get(key)):
        raise BadRow(f"missing key '{key}'")
    return as_text(row[key], f"key '{key}'")


def require_messages(row: dict, key: str, need_assistant: bool = True,
                     tool_names: list[str] | None = None) -> list[dict]:
    """The `{role, content}` chat messages of `row[key]`, validated. With `tool_names` (the tools the row
    declares) they may be an OpenAI tool conversation: an assistant message's `tool_calls` of those tools (its
    content may then be empty) and `role: tool` messages with their results."""
    if is_missing(row.get(key)):
        raise BadRow(f"missing key '{key}'")
    messages = row[key]
    if not isinstance(messages, list) or not messages:
        raise BadRow(f"key '{key}' should be a non-empty list of {{role, content}} messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"key '{key}' message {i}"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRow(f"{where} should be a dict with a 'role' string")
        if message.get("tool_calls") or (tool_names is not None and message["role"] == "tool"):
            checked.append(_tool_message(message, where, tool_names, checked[-1] if checked else None))
            continue
        if is_missing(message.get("content")):
            raise BadRow(f"{where} has no 'content'")
        content = as_text(message["content"], f"{where} content")
        checked.append({"role": message["role"], "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in checked):
        raise BadRow(f"key '{key}' has no assistant message to train on")
    return checked


def _tool_message(message: dict, where: str, tool_names: list[str] | None, previous: dict | None) -> dict:
    """An assistant message's tool calls, or a tool's result (after them), as the rollout's tools render them."""
    if tool_names is None:
        raise BadRow(f"{where} has tool_calls, which only SFT conversations take (with their tools in a column)")
    content = message.get("content")  # may be empty beside tool calls, and in a tool's result
    content = "" if is_missing(content) or content == "" else as_text(content, f"{where} content")
    if message["role"] == "tool":
        if previous is None or not (previous.get("tool_calls") or previous["role"] == "tool"):
            raise BadRow(f"{where} is a tool result with no tool call before it (an assistant message's tool_calls)")
        return {"role": "tool", "content": content} | {
            k: message[k] for k in ("tool_call_id", "name") if isinstance(message.get(k), str)}
    if message["role"] != "assistant":
        raise BadRow(f"{where} has tool_calls but its role is {message['role']!r}; only assistant messages call tools")
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise BadRow(f"{where} tool_calls should be a list of {{\"function\": {{\"name\", \"arguments\"}}}} calls")
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in tool_names:
            declared = ", ".join(tool_names) or "none"
            raise BadRow(f"{where} calls tool {name!r}, which the row's tools do not declare (they are: {declared})")
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments or {}
        except json.JSONDecodeError as e:
            raise BadRow(f"{where} call {j} ({name}) has arguments that are not JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise BadRow(f"{where} call {j} ({name}) has arguments {arguments!r:.80}, not a JSON object")
        call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{j}"
        checked.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return {"role": "assistant", "content": content, "tool_calls": checked}


def require_tools(row: dict, key: str) -> list:
    """The tool schemas of `row[key]`: a list, or its JSON text; [] when the row has none. Null values are
    dropped: Arrow-backed tables (Parquet, Arrow, save_to_disk) give every row's dicts the keys of all rows'."""
    value = row.get(key)
    if is_missing(value):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRow(f"key '{key}' is text that is not JSON ({e}); give a list of OpenAI tool schemas") from None
    if not isinstance(value, list):
        raise BadRow(f"key '{key}' should be a list of OpenAI tool schemas, got {type(value).__name__}")
    return [_without_nulls(schema) for schema in value]


def _without_nulls(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return [_without_nulls(v) for v in value] if isinstance(value, list) else value


def text_budget(tokenizer, max_tokens: int) -> int:
    """Characters of text beyond which its first `max_tokens` tokens are already fixed: those come from its first
    `max_tokens * L` characters, L the longest string of the vocabulary (`longest_token_chars`). The budget is
    twice that: a cut changes only the tokens of the word it falls in, far beyond the ones kept. A longer text
    is cut to it before tokenizing, so that no time or memory goes to tokens that truncation drops."""
    return 2 * (max_tokens + 1) * longest_token_chars(tokenizer)


def context_of(row: dict, split_cfg) -> list[dict] | str:
    """What comes before the model's turn: the `messages_key` column (chat messages), else the `prompt_key` column
    (text, or chat messages), as chat messages for the chat template (a text prompt becomes one user turn when
    `apply_chat_template` is on) or as the raw prompt text when it is off."""
    messages_key, prompt_key = split_cfg.messages_key, split_cfg.prompt_key
    if not is_missing(row.get(messages_key)):
        return require_messages(row, messages_key, need_assistant=False)
    if isinstance(row.get(prompt_key), list):
        return require_messages(row, prompt_key, need_assistant=False)
    if is_missing(row.get(prompt_key)):
        raise BadRow(f"missing key '{prompt_key}' (or '{messages_key}' with the conversation so far)")
    text = require_text(row, prompt_key)
    return [{"role": "user", "content": text}] if split_cfg.apply_chat_template else text


def tokenize_messages(tokenizer, messages: list[dict], train_from: int = 0, max_length: int | None = None,
                      render: Callable[[list[dict], bool], str] | None = None) -> dict:
    """Apply the chat template (or `render(messages, add_generation_prompt)`) to `{role, content}` messages turn
    by turn; only assistant turns from message `train_from` on are in the loss (those before it are context).
    Each turn's tokens are the text the template adds for it, so they add up to the whole conversation's, and
    the assistant header (`<|im_start|>assistant\\n`) belongs to the prompt part before it, not to the loss.
    Messages between two assistant turns are rendered together (a template may merge them, as tool results).
    With `max_length` (the example is truncated to it afterwards) contents are cut first (`text_budget`), and
    turns past the first `max_length` tokens are not tokenized."""
    if max_length is not None:
        budget = text_budget(tokenizer, max_length)
        messages = [m | {"content": m["content"][:budget]} if len(m["content"]) > budget else m for m in messages]
    render = render or (lambda conversation, add_generation_prompt: tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt))
    input_ids, loss_mask = [], []
    previous = ""
    for i, message in enumerate(messages):
        if max_length is not None and len(input_ids) >= max_length:
            break
        is_assistant = message["role"] == "assistant"
        next_is_assistant = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
        if not (is_assistant or next_is_assistant or i + 1 == len(messages)):
            continue
        text = render(messages[: i + 1], next_is_assistant and not is_assistant)
        if not text.startswith(previous):
            raise BadRow("the chat template does not render this conversation turn by turn; use raw text instead")
        ids = tokenizer.encode(text[len(previous) :], add_special_tokens=False)
        input_ids += ids
        loss_mask += [int(is_assistant and i >= train_from)] * len(ids)
        previous = text
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def tokenize_prompt_response(tokenizer, context: list[dict] | str, response: str,
                             max_length: int | None = None) -> dict:
    """Context + response as one example, loss on the response (and its end-of-turn tokens): chat messages get it
    as an assistant turn through the chat template, raw text as text and an EOS token. With `max_length` (the
    example is truncated to it afterwards) texts far longer are cut first (`text_budget`)."""
    if isinstance(context, list):
        return tokenize_messages(tokenizer, context + [{"role": "assistant", "content": response}], len(context),
                                 max_length)
    if max_length is not None:
        budget = text_budget(tokenizer, max_length)
        context, response = context[:budget], response[:budget]
    prompt_ids = tokenizer.encode(context, add_special_tokens=False)
    response_ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    return {"input_ids": prompt_ids + response_ids, "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids)}


def truncate(example: dict, max_length: int) -> dict:
    """Keep the first `max_length` tokens; a row left with nothing to train on is a bad row."""
    example = {key: value[:max_length] for key, value in example.items()}
    if sum(example["loss_mask"][1:]) == 0:
        raise BadRow(f"no trainable tokens within max_length={max_length}; raise data.*.max_length")
    return example


def tokenize_rows(rows: Iterable[dict], tokenize_row: Callable[[dict], dict], source: str,
                  skip_bad_rows: bool, row_numbers: list[int] | None = None,
                  keep_row: bool = False) -> tuple[list[dict], int]:
    """(examples, number of skipped rows): every row tokenized; a bad row raises with file and row number (in
    the file: `row_numbers` gives each row's, default its position), or is skipped and counted. With `keep_row`
    each example keeps that number as `row` (a prompt's, for samples.jsonl)."""
    examples, skipped = [], 0
    for index, row in enumerate(rows):
        number = row_numbers[index] if row_numbers is not None else index
        try:
            if isinstance(row, BadRow):
                raise row
            examples.append(tokenize_row(row) | ({"row": number} if keep_row else {}))
        except BadRow as e:
            if not skip_bad_rows:
                raise DataError(f"{source} row {number}: {e} (set data.skip_bad_rows=true to skip such rows)") from None
            skipped += 1
    if not examples:
        raise DataError(f"{source}: every row is bad ({skipped} skipped)")
    return examples, skipped
