"""Loading every supported source, the SFT formats, loss masks, truncation and bad rows."""

import json
import random
import subprocess
import sys

import datasets
import pytest
from omegaconf import OmegaConf

from RL2.config import ConfigError
from RL2.config.schema import DataConfig
from RL2.datasets.loading import DataError, load_table
from RL2.datasets.sft import sft_row_tokenizer
from RL2.datasets.splits import EpochSampler, held_out_split, load_splits
from RL2.datasets.tokenize import text_budget, tokenize_messages, tokenize_prompt_response, tokenize_rows, truncate
from tests.helpers import REPO

ROWS = [
    {"prompt": "What is 2+2?", "response": "4"},
    {"prompt": "Name a colour.", "response": "Blue"},
    {"prompt": "Say hi.", "response": "Hi!"},
]


def write_all_formats(folder):
    table = datasets.Dataset.from_list(ROWS)
    paths = {}
    for suffix, writer in {
        "json": lambda p: p.write_text(json.dumps(ROWS)),
        "jsonl": lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in ROWS)),
        "csv": lambda p: table.to_csv(str(p), index=False),
        "parquet": lambda p: table.to_parquet(str(p)),
    }.items():
        paths[suffix] = folder / f"data.{suffix}"
        writer(paths[suffix])
    table.save_to_disk(str(folder / "saved"))
    paths["save_to_disk"] = folder / "saved"
    paths["arrow"] = next((folder / "saved").glob("*.arrow"))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(folder / "dict"))
    return paths


def test_every_source_loads_the_same_rows(tmp_path):
    for kind, path in write_all_formats(tmp_path).items():
        table = load_table(str(path))
        assert [dict(r) for r in table] == ROWS, kind
    assert len(load_table(f"test@{tmp_path / 'dict'}")) == 1
    assert len(load_table(f"train@{tmp_path / 'data.jsonl'}")) == 3


def test_missing_source_and_split_errors(tmp_path):
    with pytest.raises(DataError, match="not a local file or folder"):
        load_table(str(tmp_path / "nope.jsonl"))
    write_all_formats(tmp_path)
    with pytest.raises(DataError, match="no split 'validation'; it has train, test"):
        load_table(f"validation@{tmp_path / 'dict'}")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match=r"unknown file type '\.txt'"):
        load_table(str(tmp_path / "x.txt"))


def split_cfg(**overrides):
    return OmegaConf.merge(OmegaConf.structured(DataConfig).train, overrides)


def trained_text(tok, example):
    ids = [t for t, m in zip(example["input_ids"], example["loss_mask"]) if m]
    return tok.decode(ids)


def test_prompt_response_with_chat_template(tok):
    example = sft_row_tokenizer(tok)(split_cfg())(ROWS[0])
    full = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}], tokenize=False
    )
    assert tok.decode(example["input_ids"]) == full
    assert trained_text(tok, example) == "4<|im_end|>\n"


def test_prompt_response_raw_text(tok):
    example = sft_row_tokenizer(tok)(split_cfg(apply_chat_template=False))(ROWS[0])
    assert tok.decode(example["input_ids"]) == "What is 2+2?4" + tok.eos_token
    assert trained_text(tok, example) == "4" + tok.eos_token


def test_messages_train_only_assistant_turns(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "goodbye"},
    ]
    example = sft_row_tokenizer(tok)(split_cfg())({"messages": messages})
    assert tok.decode(example["input_ids"]) == tok.apply_chat_template(messages, tokenize=False)
    assert trained_text(tok, example) == "hello<|im_end|>\ngoodbye<|im_end|>\n"


def test_truncation(tok):
    example = sft_row_tokenizer(tok)(split_cfg(max_length=50))({"prompt": "a", "response": "word " * 50})
    assert len(example["input_ids"]) == 50 and len(example["loss_mask"]) == 50


@pytest.mark.parametrize(
    "row, message",
    [
        ({"response": "x"}, "missing key 'prompt'"),
        ({"prompt": {"text": "q"}, "response": "x"}, "key 'prompt' should be a string, got dict"),
        ({"prompt": "q", "response": "  "}, "key 'response' is empty"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"messages": "hello"}, "non-empty list"),
        ({"prompt": "word " * 100, "response": "x"}, "no trainable tokens within max_length=60"),
    ],
)
def test_bad_row_names_file_row_and_key(tok, row, message):
    rows = [ROWS[0], row]
    tokenize_row = sft_row_tokenizer(tok)(split_cfg(max_length=60))
    with pytest.raises(DataError, match=rf"data\.jsonl row 1: .*{message}.*skip_bad_rows"):
        tokenize_rows(rows, tokenize_row, "data.jsonl", skip_bad_rows=False)
    examples, skipped = tokenize_rows(rows, tokenize_row, "data.jsonl", skip_bad_rows=True)
    assert len(examples) == 1 and skipped == 1


def write_with_bad_utf8(path):
    """Four JSONL rows; row 1's prompt and row 2's second message hold bytes that are not UTF-8 (Latin-1 text)."""
    lines = [b'{"prompt": "q0", "response": "a0"}',
             b'{"prompt": "caf\xe9 \xff", "response": "a1"}',
             b'{"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "na\xefve"}]}',
             b'{"prompt": "q3", "response": "a3"}']
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_invalid_utf8_names_the_file_row_and_key_and_is_skipped_on_request(tok, tmp_path):
    path = tmp_path / "latin1.jsonl"
    write_with_bad_utf8(path)
    rows = load_table(str(path))
    tokenize_row = sft_row_tokenizer(tok)(split_cfg())
    message = (rf"{path} row 1: key 'prompt' is not valid UTF-8 \(byte b'\\xe9' at offset 3: invalid continuation "
               rf"byte\); write the file as UTF-8 \(set data\.skip_bad_rows=true")
    with pytest.raises(DataError, match=message):
        tokenize_rows(rows, tokenize_row, str(path), skip_bad_rows=False)
    examples, skipped = tokenize_rows(rows, tokenize_row, str(path), skip_bad_rows=True)
    # Rows 1 and 2 skipped; the rows after each bad one are still read, and read right.
    assert skipped == 2 and [trained_text(tok, e) for e in examples] == ["a0<|im_end|>\n", "a3<|im_end|>\n"]
    with pytest.raises(DataError, match=r"row 1: key 'messages' is not valid UTF-8"):  # row 2 of the file
        tokenize_rows([rows[0], rows[2], rows[3]], tokenize_row, str(path), skip_bad_rows=False)
    assert tokenize_rows(rows[:2], tokenize_row, str(path), skip_bad_rows=True)[1] == 1  # the last row
    # Held-out rows (a split with an index mapping) too, through the trainers' loader.
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig),
                          {"train": {"path": str(path), "batch_size": 1}, "test_ratio": 0.5, "skip_bad_rows": True})
    train, test = load_splits(cfg, sft_row_tokenizer(tok), seed=0)
    assert len(train) + len(test) == 2


def recorded_encode(tok, monkeypatch) -> list[int]:
    """The length of every text `tok.encode` is given from now on."""
    lengths, encode = [], tok.encode

    def recording(text, **kwargs):
        lengths.append(len(text))
        return encode(text, **kwargs)

    monkeypatch.setattr(tok, "encode", recording)
    return lengths


WORDS = ["alpha", "beta", "gamma", "delta", "3.14159", "\n", "x=y+1;", "  ", "über", "😀"]


@pytest.mark.parametrize("form", ["chat", "raw", "messages", "one_long_word"])
def test_a_huge_row_is_cut_before_it_is_tokenized_into_the_same_example(tok, monkeypatch, form):
    random.seed(0)
    huge = " ".join(random.choice(WORDS) for _ in range(60_000))  # ~330k characters
    if form == "one_long_word":  # no space, nothing to split on: BPE over one word
        huge = "".join(random.choice("abcdefghij") for _ in range(300_000))
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": huge}]} \
        if form == "messages" else {"prompt": "q", "response": huge}
    cfg = split_cfg(max_length=64, apply_chat_template=form != "raw")
    # The budget of the default tokenizer at max_length 64: 2 * 65 * 81 characters (its longest token is 81).
    assert text_budget(tok, 64) == 10_530
    lengths = recorded_encode(tok, monkeypatch)
    example = sft_row_tokenizer(tok)(cfg)(row)
    assert max(lengths) <= 10_530 + 100  # the budget plus the chat template's own text
    # The same tokens as tokenizing the whole text and truncating, as before.
    context = [{"role": "user", "content": "q"}] if form != "raw" else "q"
    whole = tokenize_prompt_response(tok, context, huge) if form != "messages" else \
        tokenize_messages(tok, row["messages"])
    assert max(lengths) > 250_000  # the whole text went to encode this time
    assert example == truncate(whole, 64)


def test_test_ratio_holds_out_rows(tok, tmp_path):
    rows = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig),
                          {"train": {"path": str(tmp_path / "d.jsonl")}, "test_ratio": 0.25})
    train, test = load_splits(cfg, sft_row_tokenizer(tok), seed=1)
    assert (len(train), len(test)) == (15, 5)
    decoded = {tok.decode(ex["input_ids"]) for ex in train} & {tok.decode(ex["input_ids"]) for ex in test}
    assert not decoded  # disjoint
    # Asked to, each example keeps its row's number in the file (what samples.jsonl's `row` names).
    train, test = load_splits(cfg, sft_row_tokenizer(tok), seed=1, keep_row=True)
    assert all(f"q{ex['row']}" in tok.decode(ex["input_ids"]) for ex in train + test)
    assert sorted(ex["row"] for ex in train + test) == list(range(20))


def test_held_out_rows_are_read_with_the_train_settings(tok, tmp_path):
    rows = [{"question": f"q{i}", "answer": f"a{i} " * 10} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # data.test keeps its defaults (prompt_key=prompt, chat template on, max_length 2048): the held-out
    # rows come from the train file, so only data.train's settings can read them.
    train_split = {"path": str(tmp_path / "d.jsonl"), "prompt_key": "question", "response_key": "answer",
                   "apply_chat_template": False, "max_length": 8}
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {"train": train_split, "test_ratio": 0.25})
    train, test = load_splits(cfg, sft_row_tokenizer(tok), seed=1)
    # Raw text, then the response and EOS, cut to 8 tokens, as data.train says.
    expected = {
        tuple((tok.encode(r["question"], add_special_tokens=False) + tok.encode(r["answer"], add_special_tokens=False)
               + [tok.eos_token_id])[:8])
        for r in rows
    }
    assert (len(train), len(test)) == (15, 5)
    assert all(len(ex["input_ids"]) == 8 and tuple(ex["input_ids"]) in expected for ex in train + test)
    assert len({tuple(ex["input_ids"]) for ex in train + test}) == 20  # every row once


@pytest.mark.parametrize("n_rows, ratio, seed", [(20, 0.25, 1), (7, 0.1, 42), (1000, 0.05, 0), (3, 0.5, 7)])
def test_held_out_rows_are_those_of_datasets_train_test_split(n_rows, ratio, seed):
    """Without `datasets` at run time the same rows are held out as when it split them."""
    expected = datasets.Dataset.from_dict({"row": range(n_rows)}).train_test_split(test_size=ratio, seed=seed)
    assert held_out_split(n_rows, ratio, seed) == {split: expected[split]["row"] for split in ("train", "test")}


def test_json_lines_break_only_at_newlines(tmp_path):
    """JSON lets a string hold U+2028, U+2029, NEL or a form feed unescaped (`ensure_ascii=False` writes them so),
    which Python's `splitlines` would take for line ends; a Windows file's lines end in CR LF."""
    rows = [{"prompt": f"a\u2028b\u2029c\x85d\x0ce {i}", "response": "r"} for i in range(2)]
    (tmp_path / "d.jsonl").write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows), encoding="utf-8")
    assert load_table(str(tmp_path / "d.jsonl")) == rows


def test_local_files_are_read_without_datasets(tmp_path):
    """`datasets` costs a process ~1 s to import: reading JSON Lines, JSON or CSV never imports it."""
    paths = write_all_formats(tmp_path)
    code = (f"import sys; from RL2.datasets.loading import load_table; "
            f"tables = [load_table(p) for p in {[str(paths[k]) for k in ('jsonl', 'json', 'csv')]}]; "
            f"assert all(len(t) == 3 for t in tables); print('datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr[-2000:]


def test_test_ratio_that_leaves_a_split_empty_names_the_key(tok, tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig),
                          {"train": {"path": str(tmp_path / "d.jsonl")}, "test_ratio": 0.5})
    with pytest.raises(DataError, match=r"d\.jsonl: cannot hold out data\.test_ratio=0\.5 of its 1 rows"
                                        r".*data\.test\.path"):
        load_splits(cfg, sft_row_tokenizer(tok), seed=1)


@pytest.mark.parametrize("name, text, message", [
    ("empty.jsonl", "", r"empty\.jsonl: the file is empty"),
    ("broken.jsonl", '{"prompt": "a", "response": "x"}\n{"prompt": "b", \n',
     r"broken\.jsonl: could not read it as JSON \(.+\); fix the file: a \.jsonl file"),
    ("ragged.csv", "prompt,response\na,b\nc,d,e\n",
     r"ragged\.csv: could not read it as CSV \(.*line 3.*\); fix the file"),
    ("cut.parquet", "PAR1 not a parquet file", r"cut\.parquet: could not read it as PARQUET \(.*\); fix the file"),
])
def test_unreadable_files_name_the_file_and_the_cause(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=message):
        load_table(str(tmp_path / name))


def test_a_file_has_only_the_train_split(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(DataError, match=r"test@.*d\.jsonl: a single file has only the split 'train'; drop 'test@'"):
        load_table(f"test@{tmp_path / 'd.jsonl'}")
    assert [dict(r) for r in load_table(f"train[:1]@{tmp_path / 'd.jsonl'}")] == [ROWS[0]]


def test_a_folder_of_files_is_named_with_the_files_to_pick(tmp_path):
    """A folder that save_to_disk did not write (data/arith of the examples) holds files to name one by one."""
    (tmp_path / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(DataError, match=rf"^{tmp_path}: a folder that datasets' save_to_disk did not write; give a "
                                        r"file in it \(test\.jsonl, train\.jsonl\) or a save_to_disk folder$"):
        load_table(str(tmp_path))


def test_sampler_visits_every_example_once_per_epoch():
    sampler = EpochSampler(10, 3, shuffle=True, seed=0)
    assert sampler.steps_per_epoch == 3
    epoch0 = [i for step in range(3) for i in sampler.batch(step)]
    assert len(set(epoch0)) == 9
    assert sampler.batch(3) != sampler.batch(0)  # a new order next epoch
    assert sampler.batch(4) == EpochSampler(10, 3, shuffle=True, seed=0).batch(4)  # a pure function of the step
    with pytest.raises(ConfigError, match="fewer than data.train.batch_size=20; lower the batch size"):
        EpochSampler(10, 20, shuffle=True, seed=0)
