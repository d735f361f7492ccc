"""SFT rows: a `messages` conversation (loss on every assistant turn), or a `response` text after a
`prompt` (text or chat messages) or after `messages` (the conversation so far)."""

from RL2.datasets.tokenize import (
    context_of,
    is_missing,
    require_messages,
    require_text,
    tokenize_messages,
    tokenize_prompt_response,
    truncate,
)


def sft_row_tokenizer(tokenizer):
    """Split config -> function(row) -> {"input_ids", "loss_mask"}."""

    def for_split(split_cfg):
        def tokenize_row(row: dict) -> dict:
            if is_missing(row.get(split_cfg.response_key)) and not is_missing(row.get(split_cfg.messages_key)):
                # A whole conversation has roles, so it always goes through the chat template.
                example = tokenize_messages(tokenizer, require_messages(row, split_cfg.messages_key),
                                            max_length=split_cfg.max_length)
            else:
                context = context_of(row, split_cfg)
                example = tokenize_prompt_response(tokenizer, context, require_text(row, split_cfg.response_key),
                                                   split_cfg.max_length)
            return truncate(example, split_cfg.max_length)

        return tokenize_row

    return for_split
