"""Preference rows for DPO, ORPO and reward models.

A row is `prompt` + `chosen` + `rejected` texts, or `chosen` and `rejected` as whole `messages`
conversations (the last assistant turn is what differs). Each row becomes a pair of examples
`{"chosen": example, "rejected": example}`, with the loss mask on the response tokens; the pair is
packed into one micro-batch so that its two sequences meet in the loss.
"""

from RL2.datasets.tokenize import (
    BadRow,
    prompt_messages,
    require_messages,
    require_text,
    tokenize_messages,
    tokenize_prompt_response,
    truncate,
)


def pair_row_tokenizer(tokenizer):
    """Split config -> function(row) -> {"chosen": example, "rejected": example}."""

    def for_split(split_cfg):
        chat = split_cfg.apply_chat_template

        def tokenize_side(row: dict, key: str) -> dict:
            if isinstance(row.get(key), list):
                example = tokenize_messages(tokenizer, require_messages(row, key))
            else:
                prompt = prompt_messages(row, split_cfg.prompt_key) if chat else require_text(row, split_cfg.prompt_key)
                example = tokenize_prompt_response(tokenizer, prompt, require_text(row, key), chat)
            return truncate(example, split_cfg.max_length)

        def tokenize_row(row: dict) -> dict:
            pair = {
                "chosen": tokenize_side(row, split_cfg.chosen_key),
                "rejected": tokenize_side(row, split_cfg.rejected_key),
            }
            if pair["chosen"]["input_ids"] == pair["rejected"]["input_ids"]:
                raise BadRow(f"'{split_cfg.chosen_key}' and '{split_cfg.rejected_key}' are identical")
            return pair

        return tokenize_row

    return for_split


def flatten_pairs(pairs: list[dict]) -> tuple[list[dict], list[list[int]]]:
    """[pair, ...] -> (examples [c0, r0, c1, r1, ...], packing units [[0, 1], [2, 3], ...])."""
    examples = [side for pair in pairs for side in (pair["chosen"], pair["rejected"])]
    units = [[2 * i, 2 * i + 1] for i in range(len(pairs))]
    return examples, units
