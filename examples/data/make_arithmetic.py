"""Generate small arithmetic datasets for the examples (nothing is downloaded).

    python examples/data/make_arithmetic.py --out data/arith             # writes sft/rl/dpo splits

- `sft_{train,test}.jsonl`: chat `messages` whose assistant turn works the sum out and ends with
  `<answer>N</answer>`;
- `rl_{train,test}.jsonl`: `prompt` (one worked example of the answer format as a previous chat
  turn, then a question on numbers below 20) plus `extra_info.answer` for the reward of
  envs/arithmetic.py (and `extra_info.question`, the question alone, for a judge's rubric).
  SmolLM2-135M-Instruct follows the format but often gets the number wrong
  (e.g. "59 + 5 = 12"): RL has room to raise the accuracy;
- `dpo_{train,test}.jsonl`: `prompt`, `chosen` (correct, well formatted), `rejected` (wrong answer).
"""

import argparse
import json
import random
from pathlib import Path

INSTRUCTION = "Put the final answer in <answer></answer> tags."
# The answer format, shown once. (Asked for in words only, the model almost never uses the tags, and
# an example inside a system message gets its number copied.)
EXAMPLE = [{"role": "user", "content": f"What is 7 + 5? {INSTRUCTION}"},
           {"role": "assistant", "content": "7 + 5 = 12. <answer>12</answer>"}]


def problem(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return f"What is {a} + {b}? {INSTRUCTION}", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}? {INSTRUCTION}", a - b


def small_problems(rng: random.Random) -> list[tuple[str, int]]:
    """Every sum and difference of a number in 2..19 and a digit (non-negative results), shuffled."""
    problems = set()
    for a in range(2, 20):
        for b in range(1, 10):
            problems.add((f"What is {a} + {b}? {INSTRUCTION}", a + b))
            problems.add((f"What is {max(a, b)} - {min(a, b)}? {INSTRUCTION}", max(a, b) - min(a, b)))
    problems = sorted(problems)
    rng.shuffle(problems)
    return problems


def rl_row(question: str, answer: int) -> dict:
    prompt = [*EXAMPLE, {"role": "user", "content": question}]
    # The question alone too, for a judge's rubric (rollout.judge, docs/rewards.md).
    return {"prompt": prompt, "extra_info": {"answer": str(answer), "question": question, "data_source": "arithmetic"}}


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
    parser.add_argument("--n-rl-test", type=int, default=64, help="held-out RL prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    seen = set()
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        sft, dpo = [], []
        while len(sft) < n:
            question, answer = problem(rng)
            if question in seen:  # keep test questions out of the training set
                continue
            seen.add(question)
            good = worked_answer(question, answer)
            wrong = answer + rng.choice([-10, -1, 1, 10])
            sft.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": good}]})
            dpo.append({"prompt": question, "chosen": good, "rejected": worked_answer(question, wrong)})
        write(out / f"sft_{split}.jsonl", sft)
        write(out / f"dpo_{split}.jsonl", dpo)
    small = small_problems(rng)
    write(out / "rl_test.jsonl", [rl_row(*p) for p in small[: args.n_rl_test]])
    write(out / "rl_train.jsonl", [rl_row(*p) for p in small[args.n_rl_test :]])
    print(f"wrote {args.n_train} train and {args.n_test} test rows of SFT and DPO data, and "
          f"{len(small) - args.n_rl_test} train and {args.n_rl_test} test RL prompts to {out}")


if __name__ == "__main__":
    main()
