"""Every documented row form loads in the trainers that take it, and tokenizes to what the chat
template (or plain concatenation) applied by hand gives; CSV text columns stay text; bad rows name
file, row and key.

The ORIGINAL_* rows are the examples of RL2's original README, verbatim (JSON arrays).
"""

import json
import re

import pytest
from omegaconf import OmegaConf

from RL2.config.schema import DataConfig
from RL2.datasets.loading import DataError, load_table
from RL2.datasets.splits import load_splits
from RL2.datasets.tokenize import tokenize_rows
from tests.helpers import REPO

CHINA = [{"role": "user", "content": "What is the capital of China?"}]

ORIGINAL_SFT = [
    [{"prompt": "The capital of China is", "response": "Beijing."}],
    [{"messages": CHINA + [{"role": "assistant", "content": "Beijing."}]}],
]
ORIGINAL_PAIRS = [
    [{"prompt": "The capital of China is", "chosen": "Beijing.", "rejected": "Shanghai."}],
    [{"messages": CHINA, "chosen": "Beijing.", "rejected": "Shanghai."}],
    [{"chosen": CHINA + [{"role": "assistant", "content": "Beijing."}],
      "rejected": CHINA + [{"role": "assistant", "content": "Shanghai."}]}],
]
ORIGINAL_PPO = [
    [{"prompt": "The capital of China is", "extra_info": {"answer": "Beijing"}}],
    [{"messages": CHINA, "extra_info": {"answer": "Beijing"}}],
    # older versions of the original README
    [{"prompt": "The capital of China is", "answer": "Beijing"}],
    [{"messages": CHINA, "answer": "Beijing"}],
    [{"messages": [{"role": "system", "content": "You are a helpful assistant."}] + CHINA, "answer": "Beijing"}],
    [{"prompt": "Use 1, 3, 4, and 6 exactly once to make 24.", "numbers": [1, 3, 4, 6], "target": 24,
      "extra_info": {"answer": "(6 / (1 - 3 / 4))"}}],
]


def data_cfg(path, **split):
    return OmegaConf.merge(OmegaConf.structured(DataConfig), {"train": {"path": str(path), **split}})


def write_json(tmp_path, rows, name="data.json"):
    path = tmp_path / name
    path.write_text(json.dumps(rows, indent=4))
    return path


def trainer_tokenizers():
    """The row tokenizer each trainer module loads its data with."""
    from RL2.trainer import distill, dpo, orpo, pairwise, rm, rollout_setup, sft

    assert all(issubclass(t, pairwise.PairwiseTrainer) for t in (dpo.DPOTrainer, orpo.ORPOTrainer, rm.RMTrainer))
    assert issubclass(distill.DistillTrainer, sft.SFTTrainer)
    return {"sft": sft.sft_rows, "distill": sft.sft_rows, "dpo": pairwise.pair_row_tokenizer,
            "orpo": pairwise.pair_row_tokenizer, "rm": pairwise.pair_row_tokenizer,
            "ppo": rollout_setup.prompt_row_tokenizer}


def load(tok, kind, path, **split):
    train, _ = load_splits(data_cfg(path, **split), trainer_tokenizers()[kind](tok), seed=0)
    return train


def chat_ids(tok, messages, generation_prompt=False):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tok.encode(text, add_special_tokens=False)


def expected_chat_example(tok, context, response):
    """The whole conversation through the template; the loss from the assistant's first token on."""
    ids = chat_ids(tok, context + [{"role": "assistant", "content": response}])
    n_context = len(chat_ids(tok, context, generation_prompt=True))
    return {"input_ids": ids, "loss_mask": [0] * n_context + [1] * (len(ids) - n_context)}


def expected_raw_example(tok, prompt, response):
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    response_ids = tok.encode(response, add_special_tokens=False) + [tok.eos_token_id]
    return {"input_ids": prompt_ids + response_ids, "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids)}


def test_trained_tokens_are_the_response_and_its_end_of_turn(tok):
    example = expected_chat_example(tok, CHINA, "Beijing.")
    trained = [t for t, m in zip(example["input_ids"], example["loss_mask"]) if m]
    assert tok.decode(trained) == "Beijing.<|im_end|>\n"  # the expectation itself is what docs/data.md says


@pytest.mark.parametrize("kind", ["sft", "distill"])
@pytest.mark.parametrize("chat", [True, False])
def test_original_sft_rows(tok, tmp_path, kind, chat):
    text, conversation = ORIGINAL_SFT
    [example] = load(tok, kind, write_json(tmp_path, text), apply_chat_template=chat)
    if chat:
        user = [{"role": "user", "content": "The capital of China is"}]
        assert example == expected_chat_example(tok, user, "Beijing.")
    else:  # RL2's original reading of prompt/response rows: the texts concatenated, EOS appended
        assert example == expected_raw_example(tok, "The capital of China is", "Beijing.")
    [example] = load(tok, kind, write_json(tmp_path, conversation), apply_chat_template=chat)
    assert example == expected_chat_example(tok, CHINA, "Beijing.")  # messages always use the template


def test_sft_multi_turn_and_response_after_messages(tok, tmp_path):
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    rows = [{"messages": turns + [{"role": "assistant", "content": "goodbye"}]},
            {"messages": turns, "response": "goodbye"},
            {"prompt": turns, "response": "goodbye"}]
    whole, after_messages, after_prompt_list = load(tok, "sft", write_json(tmp_path, rows))
    ids = chat_ids(tok, turns + [{"role": "assistant", "content": "goodbye"}])
    assert whole["input_ids"] == after_messages["input_ids"] == after_prompt_list["input_ids"] == ids
    trained = lambda ex: tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])  # noqa: E731
    assert trained(whole) == "hello<|im_end|>\ngoodbye<|im_end|>\n"  # every assistant turn of a conversation
    assert trained(after_messages) == trained(after_prompt_list) == "goodbye<|im_end|>\n"  # only the response


@pytest.mark.parametrize("kind", ["dpo", "orpo", "rm"])
def test_original_preference_rows(tok, tmp_path, kind):
    for rows in ORIGINAL_PAIRS:
        [pair] = load(tok, kind, write_json(tmp_path, rows))
        context = CHINA if "prompt" not in rows[0] else [{"role": "user", "content": "The capital of China is"}]
        assert pair == {"chosen": expected_chat_example(tok, context, "Beijing."),
                        "rejected": expected_chat_example(tok, context, "Shanghai.")}, rows
    [pair] = load(tok, kind, write_json(tmp_path, ORIGINAL_PAIRS[0]), apply_chat_template=False)
    assert pair == {"chosen": expected_raw_example(tok, "The capital of China is", "Beijing."),
                    "rejected": expected_raw_example(tok, "The capital of China is", "Shanghai.")}


def test_preference_assistant_turns_after_the_prompt(tok, tmp_path):
    """TRL's conversational form: the prompt as messages, each side only the assistant's reply."""
    rows = [{"prompt": CHINA, "chosen": [{"role": "assistant", "content": "Beijing."}],
             "rejected": [{"role": "assistant", "content": "Shanghai."}]}]
    [pair] = load(tok, "dpo", write_json(tmp_path, rows))
    assert pair["chosen"] == expected_chat_example(tok, CHINA, "Beijing.")
    assert pair["rejected"] == expected_chat_example(tok, CHINA, "Shanghai.")


def test_preference_conversations_are_trained_where_chosen_and_rejected_part(tok, tmp_path):
    """The turns both sides begin with are the conversation so far, not part of either response: as
    whole conversations and as assistant turns after a prompt alike."""
    before = CHINA + [{"role": "assistant", "content": "Beijing."}, {"role": "user", "content": "And of France?"}]
    rows = [{"chosen": before + [{"role": "assistant", "content": "Paris."}],
             "rejected": before + [{"role": "assistant", "content": "Lyon."}]},
            {"prompt": CHINA, "chosen": before[1:] + [{"role": "assistant", "content": "Paris."}],
             "rejected": before[1:] + [{"role": "assistant", "content": "Lyon."}]}]
    whole, after_prompt = load(tok, "dpo", write_json(tmp_path, rows))
    for pair in (whole, after_prompt):
        assert pair["chosen"] == expected_chat_example(tok, before, "Paris.")
        assert pair["rejected"] == expected_chat_example(tok, before, "Lyon.")


@pytest.mark.parametrize("chat", [True, False])
def test_original_ppo_rows(tok, tmp_path, chat):
    def generation_prompt(messages):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def text(prompt):  # a text prompt goes through the template only with apply_chat_template
        return generation_prompt([{"role": "user", "content": prompt}]) if chat else prompt

    system = [{"role": "system", "content": "You are a helpful assistant."}]
    expected_prompts = [text("The capital of China is"), generation_prompt(CHINA), text("The capital of China is"),
                        generation_prompt(CHINA), generation_prompt(system + CHINA),
                        text("Use 1, 3, 4, and 6 exactly once to make 24.")]
    loaded = [load(tok, "ppo", write_json(tmp_path, rows), apply_chat_template=chat)[0] for rows in ORIGINAL_PPO]
    assert [row["prompt"] for row in loaded] == expected_prompts
    assert [row["prompt_ids"] for row in loaded] == [tok.encode(p, add_special_tokens=False) for p in expected_prompts]
    assert [row["extra_info"] for row in loaded] == [{"answer": "Beijing"}] * 5 + [
        {"numbers": [1, 3, 4, 6], "target": 24, "answer": "(6 / (1 - 3 / 4))"}]


def test_ppo_extra_info_dict_wins_over_a_column_of_the_same_name(tok, tmp_path):
    rows = [{"prompt": "q", "answer": "column", "extra_info": {"answer": "dict", "data_source": "s"}}]
    [row] = load(tok, "ppo", write_json(tmp_path, rows))
    assert row["extra_info"] == {"answer": "dict", "data_source": "s"}


@pytest.mark.parametrize("suffix", ["json", "parquet"])
def test_ppo_extra_info_null_from_other_rows_leaves_the_column(tok, tmp_path, suffix):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Arrow gives every row's extra_info the keys of all rows' dicts: row 0's dict reads
    # {"answer": None, "index": 0}, which must not hide its answer column.
    rows = [{"prompt": "The capital of China is", "answer": "Beijing", "extra_info": {"index": 0}},
            {"prompt": "Make 24.", "answer": None, "extra_info": {"answer": "(6 / (1 - 3 / 4))", "index": 1}}]
    path = tmp_path / f"data.{suffix}"
    if suffix == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        write_json(tmp_path, rows, path.name)
    loaded = load(tok, "ppo", path)
    assert [row["extra_info"] for row in loaded] == [{"answer": "Beijing", "index": 0},
                                                     {"answer": "(6 / (1 - 3 / 4))", "index": 1}]


def test_ppo_rows_without_a_prompt_when_the_environment_resets(tok, tmp_path):
    from RL2.datasets.prompts import prompt_row_tokenizer

    path = write_json(tmp_path, [{"extra_info": {"env_id": "game:Sudoku-v0-easy", "seed": 3}}])
    [row], _ = load_splits(data_cfg(path), prompt_row_tokenizer(tok, env_resets=True), seed=0)
    assert row == {"prompt": None, "prompt_ids": None, "extra_info": {"env_id": "game:Sudoku-v0-easy", "seed": 3}}
    with pytest.raises(DataError, match=r"row 0: missing key 'prompt' \(or 'messages'"):
        load_splits(data_cfg(path), prompt_row_tokenizer(tok), seed=0)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(tok, monkeypatch):
    from RL2.datasets.prompts import prompt_row_tokenizer
    from RL2.datasets.tokenize import BadRow

    encoded, encode = [], tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kwargs: encoded.append(len(text)) or encode(text, **kwargs))
    tokenize_row = prompt_row_tokenizer(tok)(data_cfg("x").train)
    # 350,000 characters, more than 2 * 2049 * 81 (the default tokenizer's longest token is 81 characters):
    # certainly more than 2048 tokens, so nothing is tokenized (it took 9 s and 2 GB for 9 MB).
    with pytest.raises(BadRow, match=r"the prompt has 350\d{3} characters, more than max_length=2048 tokens can hold"):
        tokenize_row({"prompt": "word " * 70_000})
    assert encoded == []
    assert tokenize_row({"prompt": "word " * 1000})["prompt_ids"] and encoded  # an ordinary one is tokenized


# ---- CSV and typed sources: text columns stay text ------------------------------------------------


def write_csv(tmp_path, text, name="data.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_csv_numeric_text_columns_stay_text(tok, tmp_path):
    path = write_csv(tmp_path, 'prompt,response\nWhat is 9 plus 37?,"9 plus 37 is, 46."\nWhat is 40 plus 6?,46\n'
                               "Say NA.,NA\nSay None.,None\n")
    assert [dict(r) for r in load_table(str(path))] == [
        {"prompt": "What is 9 plus 37?", "response": "9 plus 37 is, 46."},
        {"prompt": "What is 40 plus 6?", "response": "46"},
        {"prompt": "Say NA.", "response": "NA"},
        {"prompt": "Say None.", "response": "None"},
    ]
    examples = load(tok, "sft", path)
    context = [{"role": "user", "content": "What is 40 plus 6?"}]
    assert examples[1] == expected_chat_example(tok, context, "46")


def test_csv_numeric_columns_for_every_trainer(tok, tmp_path):
    pairs = write_csv(tmp_path, "prompt,chosen,rejected\nWhat is 40 plus 6?,46,47\n", "pairs.csv")
    [pair] = load(tok, "rm", pairs)
    context = [{"role": "user", "content": "What is 40 plus 6?"}]
    assert pair == {"chosen": expected_chat_example(tok, context, "46"),
                    "rejected": expected_chat_example(tok, context, "47")}
    prompts = write_csv(tmp_path, "prompt,answer\nWhat is 40 plus 6?,46\n", "prompts.csv")
    [row] = load(tok, "ppo", prompts)
    assert row["extra_info"] == {"answer": "46"}  # a CSV's columns reach the environment as text


def test_csv_empty_cell_is_missing_not_nan(tok, tmp_path):
    path = write_csv(tmp_path, "prompt,response\nWhat is 40 plus 6?,46\nWhat is 2 plus 2?,\n")
    assert dict(load_table(str(path))[1]) == {"prompt": "What is 2 plus 2?", "response": None}
    with pytest.raises(DataError, match=r"data\.csv row 1: missing key 'response'"):
        load(tok, "sft", path)


def test_numbers_in_typed_text_columns_are_their_text(tok, tmp_path):
    rows = [{"prompt": "What is 40 plus 6?", "response": 46}, {"prompt": "Half of 9?", "response": 4.5}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load(tok, "sft", path)
    for row, example in zip(rows, examples):
        assert example == expected_chat_example(tok, [{"role": "user", "content": row["prompt"]}], str(row["response"]))
    nan = {"prompt": "q", "response": float("nan")}  # how pandas and parquet floats write an empty cell
    with pytest.raises(DataError, match="row 0: missing key 'response'"):
        tokenize_rows([nan], trainer_tokenizers()["sft"](tok)(data_cfg("x").train), "d.parquet", False)


# ---- bad rows --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, row, message",
    [
        ("ppo", {"extra_info": {"answer": 1}}, "missing key 'prompt' (or 'messages'"),
        ("ppo", {"prompt": "q", "extra_info": "46"}, "key 'extra_info' should be a dict"),
        ("ppo", {"messages": [{"role": "user"}]}, "key 'messages' message 0 has no 'content'"),
        ("ppo", {"prompt": True}, "key 'prompt' should be a string, got bool"),
        ("dpo", {"messages": CHINA, "chosen": "Beijing."}, "missing key 'rejected'"),
        ("dpo", {"chosen": "Beijing.", "rejected": "Shanghai."}, "missing key 'prompt' (or 'messages'"),
        ("rm", {"chosen": CHINA, "rejected": CHINA}, "key 'chosen' has no assistant message"),
        ("rm", {"messages": CHINA, "chosen": "Beijing.", "rejected": "Beijing."},
         "'chosen' and 'rejected' are identical"),
        ("dpo", {"prompt": "q", "chosen": "word " * 2100 + "Beijing.", "rejected": "word " * 2100 + "Shanghai."},
         "'chosen' and 'rejected' are identical in their first max_length=2048 tokens"),
        # Parting after the characters tokenized (`text_budget`, 331,938 at max_length 2048): still told apart.
        ("dpo", {"prompt": "q", "chosen": "word " * 70_000 + "Beijing.", "rejected": "word " * 70_000 + "Shanghai."},
         "'chosen' and 'rejected' are identical in their first max_length=2048 tokens"),
        ("sft", {"messages": CHINA}, "key 'messages' has no assistant message"),
        ("sft", {"prompt": {"text": "q"}, "response": "a"}, "key 'prompt' should be a string, got dict"),
    ],
)
def test_bad_rows_name_file_row_and_key(tok, kind, row, message):
    good = {"ppo": {"prompt": "q"}, "dpo": ORIGINAL_PAIRS[0][0], "rm": ORIGINAL_PAIRS[0][0],
            "sft": ORIGINAL_SFT[0][0]}[kind]
    tokenize_row = trainer_tokenizers()[kind](tok)(data_cfg("x").train)
    with pytest.raises(DataError, match=rf"data\.jsonl row 1: {re.escape(message)}.*skip_bad_rows"):
        tokenize_rows([good, row], tokenize_row, "data.jsonl", skip_bad_rows=False)
    examples, skipped = tokenize_rows([good, row], tokenize_row, "data.jsonl", skip_bad_rows=True)
    assert len(examples) == 1 and skipped == 1



# ---- the examples of docs/data.md --------------------------------------------------------------------


def data_page_examples() -> list[tuple[str, list[dict]]]:
    """(trainers, rows) of every JSON example in docs/data.md."""
    section = (REPO / "docs" / "data.md").read_text()
    examples = []
    for part in section.split("**")[1::2]:  # each bold header names the trainers of the blocks after it
        block = section.split(f"**{part}**", 1)[1].split("**", 1)[0]
        kinds = re.findall(r"RL2\.trainer\.(\w+)", block.split("```", 1)[0])
        examples += [(kind, json.loads(rows))
                     for rows in re.findall(r"```json\n(.*?)```", block, re.S) for kind in kinds]
    return examples


def test_every_data_page_example_loads_in_its_trainers(tok, tmp_path):
    examples = data_page_examples()
    assert {kind for kind, _ in examples} == {"sft", "distill", "dpo", "orpo", "rm", "ppo"}
    for kind, rows in examples:
        loaded = load(tok, kind, write_json(tmp_path, rows))
        assert len(loaded) == len(rows), kind
