"""Generate small arithmetic datasets for the examples (nothing is downloaded).

    python examples/data/make_arithmetic.py --out data/arith             # writes sft/rl/dpo splits

- `sft_{train,test}.jsonl`: chat `messages` whose assistant turn works the sum out and ends with
  `<answer>N</answer>`;
- `rl_{train,test}.jsonl`: `prompt` (a system message asking for the answer in tags, then the
  question) plus `extra_info.answer` for the reward of envs/arithmetic.py. SmolLM2-135M-Instruct
  rarely follows that format at first and gets about a third of the sums right when it does: RL has
  both to learn;
- `dpo_{train,test}.jsonl`: `prompt`, `chosen` (correct, well formatted), `rejected` (wrong answer).
"""

import argparse
import json
import random
from pathlib import Path

INSTRUCTION = "Put the final answer in <answer></answer> tags."
SYSTEM = ("You are a helpful assistant. You answer math questions and always end with the final answer "
          "in tags, like <answer>56</answer>.")


def problem(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return f"What is {a} + {b}? {INSTRUCTION}", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}? {INSTRUCTION}", a - b


def worked_answer(question: str, answer: int) -> str:
    expression = question.split("What is ")[1].split("?")[0]
    return f"{expression} = {answer}. <answer>{answer}</answer>"


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/arith", help="output folder")
    parser.add_argument("--n-train", type=int, default=1024)
    parser.add_argument("--n-test", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    seen = set()
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        sft, rl, dpo = [], [], []
        while len(rl) < n:
            question, answer = problem(rng)
            if question in seen:  # keep test questions out of the training set
                continue
            seen.add(question)
            good = worked_answer(question, answer)
            wrong = answer + rng.choice([-10, -1, 1, 10])
            sft.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": good}]})
            prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            rl.append({"prompt": prompt, "extra_info": {"answer": str(answer), "data_source": "arithmetic"}})
            dpo.append({"prompt": question, "chosen": good, "rejected": worked_answer(question, wrong)})
        write(out / f"sft_{split}.jsonl", sft)
        write(out / f"rl_{split}.jsonl", rl)
        write(out / f"dpo_{split}.jsonl", dpo)
    print(f"wrote {args.n_train} train and {args.n_test} test rows of each kind to {out}")


if __name__ == "__main__":
    main()
