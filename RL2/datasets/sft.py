"""SFT rows: a `messages` conversation (loss on every assistant turn), or a `response` text after a
`prompt` (text or chat messages) or after `messages` (the conversation so far). A conversation may be an
OpenAI tool conversation (assistant `tool_calls`, `role: tool` results, the schemas in a `tools` column),
rendered as the rollout renders it; the loss is on the assistant turns, calls included, never on results."""

from collections.abc import Callable
from functools import partial

from RL2.datasets.tokenize import (
    context_of,
    is_missing,
    require_messages,
    require_text,
    require_tools,
    tokenize_messages,
    tokenize_prompt_response,
    truncate,
)


def sft_row_tokenizer(tokenizer, tool_conversations: Callable | None = None):
    """Split config -> function(row) -> {"input_ids", "loss_mask"}. `tool_conversations(schemas)`: for a row's
    tool schemas, (the names of its tools, `render(messages, add_generation_prompt)` as the rollout renders a
    conversation with them); None: conversations with tools are refused."""
    return lambda split_cfg: partial(_sft_example, tokenizer, tool_conversations, split_cfg)


def _sft_example(tokenizer, tool_conversations: Callable | None, split_cfg, row: dict) -> dict:
    if is_missing(row.get(split_cfg.response_key)) and not is_missing(row.get(split_cfg.messages_key)):
        # A whole conversation has roles, so it always goes through the chat template.
        names, render = tool_conversations(require_tools(row, split_cfg.tools_key)) if tool_conversations else (
            None, None)
        example = tokenize_messages(tokenizer, require_messages(row, split_cfg.messages_key, tool_names=names),
                                    max_length=split_cfg.max_length, render=render)
    else:
        example = tokenize_prompt_response(tokenizer, context_of(row, split_cfg),
                                           require_text(row, split_cfg.response_key), split_cfg.max_length)
    return truncate(example, split_cfg.max_length)
