"""Generate the tool-use example's data (nothing is downloaded): envs/tool_use.py's tasks.

    python examples/data/make_tool_use.py --out data/tool_use

- `corpus.jsonl`: an encyclopedia of made-up countries (their capitals and rivers), which the
  `search` tool indexes with BM25: facts no model can know without searching;
- `rl_{train,test}.jsonl`: a question as a chat `prompt` (a product of two 3-digit numbers, which a
  small model cannot work out in its head, or a country's capital) with `extra_info.answer` and the
  corpus path; test questions use other numbers and other countries;
- `sft_train.jsonl`: conversations that answer training questions with one tool call, in OpenAI's format
  (the assistant's `tool_calls`, the `role: tool` result, the schemas in a `tools` column), which
  RL2.trainer.sft renders as the rollout renders the environment's tools.
"""

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from RL2.rollout.env import load_env  # noqa: E402
from RL2.rollout.tools.declared import build_tools  # noqa: E402

SYLLABLES = ["ka", "lo", "mi", "ra", "te", "vu", "zo", "ne", "pi", "da", "sha", "ul", "or", "bel", "tan", "qui"]


def made_up_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in taken:
            taken.add(name)
            return name


def countries(rng: random.Random, n: int) -> list[dict]:
    taken: set[str] = set()
    return [{"country": made_up_name(rng, taken) + "ia", "capital": made_up_name(rng, taken),
             "river": made_up_name(rng, taken)} for _ in range(n)]


def corpus(places: list[dict]) -> list[dict]:
    rows = []
    for p in places:
        rows.append({"text": f"{p['country']} is a country whose capital city is {p['capital']}."})
        rows.append({"text": f"The longest river of {p['country']} is the {p['river']}."})
    return rows


def question_rows(rng: random.Random, places: list[dict], n_products: int, corpus_path: str) -> list[dict]:
    rows = []
    for _ in range(n_products):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append(row(f"What is {a} times {b}?", a * b, "calculator", corpus_path, ("multiply", {"a": a, "b": b})))
    for p in places:
        call = ("search", {"query": f"capital of {p['country']}"})
        rows.append(row(f"What is the capital of {p['country']}?", p["capital"], "search", corpus_path, call))
    rng.shuffle(rows)
    return rows


def row(question: str, answer, source: str, corpus_path: str, call: tuple[str, dict]) -> dict:
    return {"prompt": [{"role": "user", "content": question}],
            "extra_info": {"answer": str(answer), "corpus": corpus_path, "data_source": source}, "call": call}


def sft_conversation(question_row: dict, tools: dict, schemas: list[dict]) -> dict:
    """One call, its result (from the environment's own tool), and the answer."""
    name, arguments = question_row["call"]
    fn = tools[name].fn
    result = fn(**arguments, extra_info=question_row["extra_info"]) if tools[name].takes_extra_info else fn(**arguments)
    conversation = [
        *question_row["prompt"],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "content": str(result), "tool_call_id": "call_0", "name": name},
        {"role": "assistant", "content": f"The answer is {question_row['extra_info']['answer']}."},
    ]
    return {"messages": conversation, "tools": schemas}


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/tool_use")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    places = countries(rng, 240)
    corpus_path = str(out / "corpus.jsonl")
    write(Path(corpus_path), corpus(places))
    train = question_rows(rng, places[:200], 200, corpus_path)
    test = question_rows(rng, places[200:], 40, corpus_path)
    env = load_env(str(REPO / "envs" / "tool_use.py"))
    tools = build_tools(env.tool_specs, env.path)
    schemas = [tool.schema for tool in tools.values()]
    write(out / "sft_train.jsonl", [sft_conversation(r, tools, schemas) for r in train])
    for name, rows in (("rl_train", train), ("rl_test", test)):
        write(out / f"{name}.jsonl", [{k: v for k, v in r.items() if k != "call"} for r in rows])
    print(f"wrote {out}: {len(train)} train and {len(test)} test questions, {2 * len(places)} passages")


if __name__ == "__main__":
    main()
