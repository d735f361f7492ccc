"""SFT rows: `messages` conversations, or `prompt` + `response` pairs."""

from RL2.datasets.tokenize import (
    prompt_messages,
    require_messages,
    require_text,
    tokenize_messages,
    tokenize_prompt_response,
    truncate,
)


def sft_row_tokenizer(tokenizer):
    """Split config -> function(row) -> {"input_ids", "loss_mask"}."""

    def for_split(split_cfg):
        chat = split_cfg.apply_chat_template

        def tokenize_row(row: dict) -> dict:
            if row.get(split_cfg.messages_key) is not None:
                # A conversation has roles, so it always goes through the chat template.
                example = tokenize_messages(tokenizer, require_messages(row, split_cfg.messages_key))
            else:
                prompt = prompt_messages(row, split_cfg.prompt_key) if chat else require_text(row, split_cfg.prompt_key)
                response = require_text(row, split_cfg.response_key)
                example = tokenize_prompt_response(tokenizer, prompt, response, chat)
            return truncate(example, split_cfg.max_length)

        return tokenize_row

    return for_split
