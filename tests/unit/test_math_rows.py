"""GSM8K- and MATH-style rows, written in those datasets' schemas, turned into PPO prompt rows whose
answers the math reward checks."""

import json

import datasets
import pytest

from RL2.datasets.loading import DataError, load_table
from RL2.datasets.math_rows import DEFAULT_PROMPT, detect_format, gsm8k_answer, main, math_answer, math_rows
from RL2.rewards import math_reward

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A house costs $1,250 a month. What does it cost over 2 years?",
     "answer": "12 * 2 = <<12*2=24>>24 months.\n1250 * 24 = <<1250*24=30000>>30,000\n#### 30,000"},
]
MATH = [
    {"problem": "Compute $\\sin 60^\\circ$.", "level": "Level 1", "type": "Precalculus",
     "solution": "It is $\\boxed{1}$ for $90^\\circ$; here $\\sin 60^\\circ = \\boxed{\\frac{\\sqrt{3}}{2}}$."},
    {"problem": "Which set is $\\{x : x^2 = 1\\}$?", "level": "Level 2", "type": "Algebra",
     "solution": "The roots are $\\pm 1$, so the set is $\\boxed{\\{-1, 1\\}}$."},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_gsm8k_rows():
    rows, skipped = math_rows(GSM8K)
    assert skipped == 0
    assert rows[0] == {
        "prompt": GSM8K[0]["question"] + "\n\nPlease reason step by step, and put your final answer within \\boxed{}.",
        "extra_info": {"answer": "72", "data_source": "gsm8k", "index": 0},
    }
    assert rows[1]["extra_info"]["answer"] == "30000"  # thousands separator dropped
    assert math_reward("So $\\boxed{30{,}000}$? No: \\boxed{30000}", rows[1]["extra_info"]) == 1.0
    assert math_reward("\\boxed{73}", rows[0]["extra_info"]) == 0.0


def test_math_rows_take_the_last_box_or_the_answer_column():
    rows, _ = math_rows(MATH, data_source="competition_math")
    assert [r["extra_info"]["answer"] for r in rows] == ["\\frac{\\sqrt{3}}{2}", "\\{-1, 1\\}"]
    assert rows[0]["extra_info"] == {"answer": "\\frac{\\sqrt{3}}{2}", "data_source": "competition_math", "index": 0,
                                     "level": "Level 1", "type": "Precalculus"}
    math500 = {"problem": "1+1?", "solution": "\\boxed{2}", "answer": "2", "subject": "Arithmetic", "unique_id": "x/1"}
    assert math_answer(math500 | {"solution": "no box"}) == "2"  # the answer column comes first
    [row], _ = math_rows([math500])
    assert row["extra_info"] == {"answer": "2", "data_source": "math", "index": 0, "subject": "Arithmetic",
                                 "unique_id": "x/1"}
    pytest.importorskip("math_verify", reason="math-verify is not installed (pip install math-verify)")
    assert math_reward("\\boxed{\\frac{\\sqrt3}{2}}", rows[0]["extra_info"]) == 1.0
    assert math_reward("so \\boxed{\\{1,-1\\}}", rows[1]["extra_info"]) == 1.0
    assert math_reward("so \\boxed{\\{1\\}}", rows[1]["extra_info"]) == 0.0


def test_a_numeric_answer_column_is_its_text(tmp_path):
    rows = [{"problem": "Find x if x+1=205.", "answer": 204}, {"problem": "Halve 5.", "answer": 2.5},
            {"problem": "What is 0.5*2?", "answer": 1.0}]
    assert [r["extra_info"]["answer"] for r in math_rows(rows)[0]] == ["204", "2.5", "1"]
    # JSON numbers of a typed column, read through the loader the trainers use.
    table = load_table(str(write_jsonl(tmp_path / "math.jsonl", rows)))
    assert [r["extra_info"]["answer"] for r in math_rows(table)[0]] == ["204", "2.5", "1"]
    # A missing answer (None, or the NaN of a float column) still falls back to the solution.
    assert math_answer({"answer": float("nan"), "solution": "so \\boxed{3}"}) == "3"
    with pytest.raises(DataError, match=r"row 0: key 'answer' should be a string, got bool"):
        math_rows([{"problem": "p", "answer": True}])


def test_formats_prompts_and_bad_rows():
    assert detect_format(GSM8K[0]) == "gsm8k" and detect_format(MATH[0]) == "math"
    with pytest.raises(DataError, match=r"cannot tell the format from the columns \['input', 'target'\]"):
        detect_format({"input": "q", "target": "a"})
    assert gsm8k_answer("so\n#### -1,234,567") == "-1234567"
    rows, _ = math_rows(GSM8K[:1], "gsm8k", prompt="Q: {question} Put it in \\boxed{}.")
    assert rows[0]["prompt"] == f"Q: {GSM8K[0]['question']} Put it in \\boxed{{}}."
    with pytest.raises(ValueError, match="placeholder"):
        math_rows(GSM8K, prompt="no question here")
    bad = [GSM8K[0], {"question": "q", "answer": "no final answer"}, {"question": " ", "answer": "#### 1"}]
    with pytest.raises(DataError, match="data.jsonl row 1: 'answer' has no '#### N' final answer"):
        math_rows(bad, source="data.jsonl")
    rows, skipped = math_rows(bad, skip_bad_rows=True)
    assert (len(rows), skipped) == (1, 2)
    with pytest.raises(DataError, match="row 0: 'solution' has no complete"):
        math_rows([{"problem": "p", "solution": "cut off \\boxed{3"}])


def test_command_line_on_files_folders_and_splits(tmp_path, capsys):
    source = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    out = tmp_path / "out" / "rl.jsonl"
    main([str(source), str(out)])
    assert "wrote 2 rows" in capsys.readouterr().out
    assert [json.loads(line)["extra_info"]["answer"] for line in out.read_text().splitlines()] == ["72", "30000"]
    assert load_table(str(out))[0]["extra_info"]["answer"] == "72"  # what data.train.path reads back

    folder = tmp_path / "math_folder"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(MATH), "test": datasets.Dataset.from_list(MATH[1:])}
                         ).save_to_disk(str(folder))
    main([f"test@{folder}", str(out), "--data-source", "math_test", "--prompt", "{question}"])
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row == {"prompt": MATH[1]["problem"], "extra_info": {"answer": "\\{-1, 1\\}", "data_source": "math_test",
                                                                "index": 0, "level": "Level 2", "type": "Algebra"}}


def test_a_cached_dataset_configuration(tmp_path, monkeypatch):
    """`--subset` picks a configuration, as openai/gsm8k's "main", of a dataset laid out like a hub repository."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    repo = tmp_path / "gsm8k_repo"
    (repo / "main").mkdir(parents=True)
    write_jsonl(repo / "main" / "train.jsonl", GSM8K)
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                    "    path: main/train.jsonl\n---\n")
    out = tmp_path / "rl.jsonl"
    main([str(repo), str(out), "--subset", "main", "--format", "gsm8k"])
    assert len(out.read_text().splitlines()) == 2


def test_rows_feed_the_ppo_row_tokeniser(tok):
    from omegaconf import OmegaConf

    from RL2.datasets.prompts import prompt_row_tokenizer

    [row], _ = math_rows(GSM8K[:1])
    split_cfg = OmegaConf.create({"apply_chat_template": True, "prompt_key": "prompt", "messages_key": "messages",
                                  "max_length": 1024})
    example = prompt_row_tokenizer(tok)(split_cfg)(row)
    assert example["extra_info"]["answer"] == "72"
    assert example["prompt"].endswith("<|im_start|>assistant\n") and DEFAULT_PROMPT.split("\n")[-1] in example["prompt"]


def test_command_line_bad_input_ends_with_the_message(tmp_path):
    """A row without a final answer, or a source that is not there: the file, row and what to do, as a
    message and exit status, not a traceback."""
    source = write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K[0], {"question": "q", "answer": "no final answer"}])
    with pytest.raises(SystemExit, match=rf"^math_rows: {source} row 1: 'answer' has no '#### N' final answer "
                                         r"\(gsm8k format\); fix it or pass --skip-bad-rows$"):
        main([str(source), str(tmp_path / "out.jsonl")])
    with pytest.raises(SystemExit, match=rf"^math_rows: could not load '{tmp_path}/missing\.jsonl'"):
        main([str(tmp_path / "missing.jsonl"), str(tmp_path / "out.jsonl")])
