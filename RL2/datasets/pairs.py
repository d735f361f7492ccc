"""Preference rows for DPO, ORPO and reward models (their forms: docs/data.md), each a pair of examples
`{"chosen": example, "rejected": example}` with the loss mask on the response tokens. Messages the two sides
begin with alike are context (as TRL's `maybe_extract_prompt` takes the common start as the prompt).
"""

from functools import partial

from RL2.datasets.tokenize import (
    BadRow,
    context_of,
    is_missing,
    require_messages,
    require_text,
    tokenize_messages,
    tokenize_prompt_response,
    truncate,
)


def tokenize_side(tokenizer, row: dict, key: str, split_cfg, shared: int = 0) -> dict:
    """One side of a pair (`key` is the chosen or the rejected column) as an example; `shared`: how many
    messages this side begins with that the other side has too (context)."""
    max_length = split_cfg.max_length  # the example is truncated to it: far longer texts are cut before tokenizing
    if not isinstance(row.get(key), list):
        return tokenize_prompt_response(tokenizer, context_of(row, split_cfg), require_text(row, key), max_length)
    turns = require_messages(row, key)
    if is_missing(row.get(split_cfg.messages_key)) and is_missing(row.get(split_cfg.prompt_key)):
        return tokenize_messages(tokenizer, turns, train_from=shared, max_length=max_length)  # a whole conversation
    # Chat messages always go through the chat template, so a text prompt before them is a user turn.
    context = context_of(row, split_cfg)
    context = context if isinstance(context, list) else [{"role": "user", "content": context}]
    return tokenize_messages(tokenizer, context + turns, train_from=len(context) + shared, max_length=max_length)


def shared_messages(chosen: object, rejected: object) -> int:
    """How many messages two message lists begin with alike (0 unless both are lists)."""
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        return 0
    return next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))


def pair_row_tokenizer(tokenizer):
    """Split config -> function(row) -> {"chosen": example, "rejected": example}."""
    return lambda split_cfg: partial(_pair_example, tokenizer, split_cfg)


def _pair_example(tokenizer, split_cfg, row: dict) -> dict:
    shared = shared_messages(row.get(split_cfg.chosen_key), row.get(split_cfg.rejected_key))
    whole = {side: tokenize_side(tokenizer, row, key, split_cfg, shared)
             for side, key in (("chosen", split_cfg.chosen_key), ("rejected", split_cfg.rejected_key))}
    pair = {side: truncate(example, split_cfg.max_length) for side, example in whole.items()}
    if pair["chosen"]["input_ids"] == pair["rejected"]["input_ids"]:
        # `whole` is cut far beyond max_length (`text_budget`): texts that part after the cut differ.
        same = whole["chosen"]["input_ids"] == whole["rejected"]["input_ids"] and \
            row.get(split_cfg.chosen_key) == row.get(split_cfg.rejected_key)
        where = "" if same else (f" in their first max_length={split_cfg.max_length} tokens, where nothing tells "
                                 f"them apart; raise data.*.max_length")
        raise BadRow(f"'{split_cfg.chosen_key}' and '{split_cfg.rejected_key}' are identical{where}")
    return pair


def flatten_pairs(pairs: list[dict]) -> tuple[list[dict], list[list[int]]]:
    """[pair, ...] -> (examples [c0, r0, c1, r1, ...], packing units [[0, 1], [2, 3], ...])."""
    examples = [side for pair in pairs for side in (pair["chosen"], pair["rejected"])]
    units = [[2 * i, 2 * i + 1] for i in range(len(pairs))]
    return examples, units
