"""Math data as people have it, turned into PPO prompt rows that `RL2.rewards.math_reward` checks.

    python -m RL2.datasets.math_rows SOURCE OUT.jsonl [--format auto|gsm8k|math] [--prompt TEMPLATE]

SOURCE is anything `data.train.path` takes: GSM8K rows (`question`, `answer` ending in `#### N`) or MATH rows
(`problem`, and `answer` or a `solution` with a \\boxed{} answer); see docs/data.md.
"""

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from RL2.datasets.loading import DataError, load_table
from RL2.datasets.tokenize import as_text, is_missing
from RL2.rewards.extract import last_boxed

DEFAULT_PROMPT = "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{}."
FORMATS = ("auto", "gsm8k", "math")
MATH_METADATA = ("level", "type", "subject", "unique_id")


def detect_format(columns: Iterable[str]) -> str:
    """"gsm8k" or "math" from a table's column names."""
    columns = set(columns)
    if {"question", "answer"} <= columns:
        return "gsm8k"
    if "problem" in columns and ({"solution", "answer"} & columns):
        return "math"
    raise DataError(f"cannot tell the format from the columns {sorted(columns)}: GSM8K rows have 'question' and "
                    f"'answer', MATH rows 'problem' and 'solution' (or 'answer'); pass --format and check the file")


def gsm8k_answer(answer: str) -> str:
    """The final answer of a GSM8K `answer` text (the worked solution ending in `#### N`): what follows
    its last `####`, without thousands separators."""
    if "####" not in answer:
        raise ValueError("'answer' has no '#### N' final answer")
    final = answer.rsplit("####", 1)[1].strip()
    final = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", final)
    if not final:
        raise ValueError("'answer' has nothing after '####'")
    return final


def math_answer(row: dict) -> str:
    """A MATH row's final answer: its `answer` column, else the last \\boxed{...} of its `solution`."""
    answer = row.get("answer")
    if isinstance(answer, (int, float)) and not is_missing(answer):
        answer = as_text(answer, "key 'answer'")  # a number is its text, as the trainers read it (204 -> "204")
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    solution = row.get("solution")
    if not isinstance(solution, str):
        raise ValueError("no 'answer' and no 'solution' text")
    answer = last_boxed(solution)
    if not answer:
        raise ValueError("'solution' has no complete \\boxed{...} answer")
    return answer


def to_prompt_row(row: dict, fmt: str, index: int, prompt: str = DEFAULT_PROMPT,
                  data_source: str | None = None) -> dict:
    """One PPO prompt row from a GSM8K or MATH row (`fmt` "gsm8k" or "math"), the `index`-th of its source.
    `prompt`: the template, whose `{question}` is replaced by the question (other braces are left alone);
    `data_source`: extra_info["data_source"] (default: the format's name), which names test metrics."""
    question_key = "question" if fmt == "gsm8k" else "problem"
    question = row.get(question_key)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"missing or empty '{question_key}'")
    if fmt == "gsm8k":
        if not isinstance(row.get("answer"), str):
            raise ValueError("missing 'answer' text")
        answer, metadata = gsm8k_answer(row["answer"]), {}
    else:
        answer = math_answer(row)
        metadata = {key: row[key] for key in MATH_METADATA if row.get(key) is not None}
    extra_info = {"answer": answer, "data_source": data_source or fmt, "index": index} | metadata
    return {"prompt": prompt.replace("{question}", question.strip()), "extra_info": extra_info}


def math_rows(rows: Iterable[dict], fmt: str = "auto", prompt: str = DEFAULT_PROMPT, data_source: str | None = None,
              skip_bad_rows: bool = False, source: str = "rows") -> tuple[list[dict], int]:
    """PPO prompt rows from GSM8K or MATH rows (dicts, e.g. a `datasets.Dataset`); returns (rows, number
    skipped). `fmt` "auto" reads the format from the first row's keys; `source` names the rows in errors."""
    if "{question}" not in prompt:
        raise ValueError(f"the prompt template needs a {{question}} placeholder: {prompt!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    converted, skipped = [], 0
    for index, row in enumerate(rows):
        if fmt == "auto":
            fmt = detect_format(row)
        try:
            converted.append(to_prompt_row(row, fmt, index, prompt, data_source))
        except ValueError as e:
            if not skip_bad_rows:
                raise DataError(f"{source} row {index}: {e} ({fmt} format); fix it or pass --skip-bad-rows") from e
            skipped += 1
    if not converted:
        raise DataError(f"{source}: no usable rows")
    return converted, skipped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m RL2.datasets.math_rows", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="GSM8K or MATH rows: a file, a save_to_disk folder or a cached dataset name")
    parser.add_argument("out", help="the PPO prompt rows, as JSONL")
    parser.add_argument("--format", default="auto", choices=FORMATS,
                        help="the source's schema (default: from its columns)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt template; {question} is replaced")
    parser.add_argument("--data-source", default=None, help="extra_info.data_source (default: the format)")
    parser.add_argument("--subset", default=None, help="configuration of a cached hub dataset (e.g. main)")
    parser.add_argument("--skip-bad-rows", action="store_true", help="skip rows without a question or answer")
    args = parser.parse_args(argv)
    try:
        rows, skipped = math_rows(load_table(args.source, args.subset), args.format, args.prompt, args.data_source,
                                  args.skip_bad_rows, source=args.source)
    except DataError as e:  # it names the file, the row and what to do
        sys.exit(f"math_rows: {e}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {args.out}" + (f" (skipped {skipped} bad rows)" if skipped else ""))


if __name__ == "__main__":
    main()
