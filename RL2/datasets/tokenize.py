"""Rows -> token ids with a loss mask, validating every row on the way.

A tokenized example is `{"input_ids": list[int], "loss_mask": list[int]}`: `loss_mask[i] == 1` when
token i is one the model is trained to produce (the response, or the assistant turns).
"""

from collections.abc import Callable, Iterable

from RL2.datasets.loading import DataError


class BadRow(DataError):
    """One malformed row. Raised by validators; the caller adds the file and row number."""


def require_text(row: dict, key: str) -> str:
    if key not in row or row[key] is None:
        raise BadRow(f"missing key '{key}'")
    value = row[key]
    if not isinstance(value, str):
        raise BadRow(f"key '{key}' should be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadRow(f"key '{key}' is empty")
    return value


def require_messages(row: dict, key: str, need_assistant: bool = True) -> list[dict]:
    if key not in row or row[key] is None:
        raise BadRow(f"missing key '{key}'")
    messages = row[key]
    if not isinstance(messages, list) or not messages:
        raise BadRow(f"key '{key}' should be a non-empty list of {{role, content}} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRow(f"key '{key}' message {i} should be a dict with a 'role' string")
        if not isinstance(message.get("content"), str) or not message["content"].strip():
            raise BadRow(f"key '{key}' message {i} has empty or non-string 'content'")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRow(f"key '{key}' has no assistant message to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def prompt_messages(row: dict, key: str) -> list[dict]:
    """A prompt may be plain text (one user turn) or already a list of chat messages."""
    if isinstance(row.get(key), list):
        return require_messages(row, key, need_assistant=False)
    return [{"role": "user", "content": require_text(row, key)}]


def tokenize_messages(tokenizer, messages: list[dict]) -> dict:
    """Apply the chat template turn by turn; only assistant turns are in the loss.

    Each turn's tokens are the text the template adds for that turn, so the concatenation equals the
    template applied to the whole conversation, and the assistant header (`<|im_start|>assistant\\n`)
    belongs to the preceding prompt part, not to the loss.
    """
    input_ids, loss_mask = [], []
    previous = ""
    for i, message in enumerate(messages):
        is_assistant = message["role"] == "assistant"
        next_is_assistant = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(
            messages[: i + 1], tokenize=False, add_generation_prompt=next_is_assistant and not is_assistant
        )
        if not text.startswith(previous):
            raise BadRow("the chat template does not render this conversation turn by turn; use raw text instead")
        ids = tokenizer.encode(text[len(previous) :], add_special_tokens=False)
        input_ids += ids
        loss_mask += [int(is_assistant)] * len(ids)
        previous = text
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def tokenize_prompt_response(tokenizer, prompt: list[dict] | str, response: str, chat: bool) -> dict:
    """Prompt + response as one example, loss on the response (and its end-of-turn token)."""
    if chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenize_messages(tokenizer, messages + [{"role": "assistant", "content": response}])
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    response_ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    return {"input_ids": prompt_ids + response_ids, "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids)}


def tokenize_prompt(tokenizer, prompt: list[dict] | str, chat: bool) -> list[int]:
    """Prompt ids for generation (RL) or for scoring a pair (DPO/RM)."""
    if chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenizer.encode(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
    return tokenizer.encode(prompt, add_special_tokens=False)


def truncate(example: dict, max_length: int) -> dict:
    """Keep the first `max_length` tokens; a row left with nothing to train on is a bad row."""
    example = {key: value[:max_length] for key, value in example.items()}
    if sum(example["loss_mask"][1:]) == 0:
        raise BadRow(f"no trainable tokens within max_length={max_length}; raise data.*.max_length")
    return example


def tokenize_rows(
    rows: Iterable[dict], tokenize_row: Callable[[dict], dict], source: str, skip_bad_rows: bool
) -> tuple[list[dict], int]:
    """Tokenize every row; a bad row raises with file and row number, or is skipped and counted.

    Returns:
        (examples, number of skipped rows)
    """
    examples, skipped = [], 0
    for index, row in enumerate(rows):
        try:
            examples.append(tokenize_row(row))
        except BadRow as e:
            if not skip_bad_rows:
                raise DataError(f"{source} row {index}: {e} (set data.skip_bad_rows=true to skip such rows)") from None
            skipped += 1
    if not examples:
        raise DataError(f"{source}: every row is bad ({skipped} skipped)")
    return examples, skipped
