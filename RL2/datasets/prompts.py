"""Prompt rows for RL: a `prompt` (text or chat messages) or `messages` (the conversation so far), and what the
environment gets as `extra_info` (`extra_info_of`; see docs/data.md)."""

from functools import partial

from RL2.datasets.tokenize import BadRow, context_of, is_missing, text_budget

EXTRA_INFO_KEY = "extra_info"


def extra_info_of(row: dict, used_keys: set[str]) -> dict:
    """The environment's `extra_info`: the row's columns other than `used_keys`, then its `extra_info`
    (whose missing values leave a column's value in place)."""
    extra_info = {} if is_missing(row.get(EXTRA_INFO_KEY)) else row[EXTRA_INFO_KEY]
    if not isinstance(extra_info, dict):
        raise BadRow(f"key '{EXTRA_INFO_KEY}' should be a dict of values for the environment, "
                     f"got {type(extra_info).__name__}")
    columns = {key: value for key, value in row.items()
               if key not in used_keys and key != EXTRA_INFO_KEY and not is_missing(value)}
    # Arrow-backed tables (Parquet, Arrow, save_to_disk) give every row's dict the
    # keys of all rows' dicts, None where a row had none: such a None must not hide the row's column.
    extra_info = {key: value for key, value in extra_info.items() if not (is_missing(value) and key in columns)}
    return columns | extra_info


def prompt_row_tokenizer(tokenizer, env_resets: bool = False, tool_use=None, keep_messages: bool = False):
    """Split config -> function(row) -> {"prompt": text, "prompt_ids": ids, "extra_info": dict}, for `load_splits`.
    `env_resets`: a row with neither a prompt nor messages gets `prompt` None, for `reset(extra_info)` to make at
    rollout time. With `tool_use` (the environment's tools, which the prompt shows) or `keep_messages` (an agent
    script's) the row keeps its chat messages as `messages`, which tool results are appended to."""
    return lambda split_cfg: partial(_prompt_example, tokenizer, env_resets, tool_use, keep_messages, split_cfg)


def _prompt_example(tokenizer, env_resets: bool, tool_use, keep_messages: bool, split_cfg, row: dict) -> dict:
    used = {split_cfg.prompt_key, split_cfg.messages_key}
    if env_resets and all(is_missing(row.get(key)) for key in used):
        return {"prompt": None, "prompt_ids": None, "extra_info": extra_info_of(row, used)}
    context = context_of(row, split_cfg)
    if tool_use is not None and not isinstance(context, list):
        raise BadRow("the environment declares TOOLS, which the chat template shows: the prompt must be "
                     "chat messages, or text with apply_chat_template=true")
    if tool_use is not None:
        text = tool_use.render(context, tokenizer)
    elif isinstance(context, list):  # chat messages: through the template, with the assistant header
        text = tokenizer.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
    else:
        text = context
    if len(text) > text_budget(tokenizer, split_cfg.max_length):  # refused unread: it has more tokens
        raise BadRow(f"the prompt has {len(text)} characters, more than max_length={split_cfg.max_length} "
                     f"tokens can hold")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > split_cfg.max_length:
        raise BadRow(f"the prompt has {len(ids)} tokens, more than max_length={split_cfg.max_length}")
    kept = {"messages": context} if tool_use is not None or keep_messages else {}
    return {"prompt": text, "prompt_ids": ids, "extra_info": extra_info_of(row, used)} | kept
