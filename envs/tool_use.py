"""An agent with tools in the model's own format: a calculator for products the model cannot work out
in its head, and a search over a local corpus for facts it cannot know (examples/data/make_tool_use.py).

The policy calls `multiply`, `add` or `search` as its chat template says (RL2's default Hermes-style
`<tool_call>` JSON for templates that know no tools), reads the results, and answers. Only the answer
(an action that calls no tool) is scored: 1 when it holds `extra_info["answer"]` (for a number, the last
number it writes), else 0.
"""

import json
import math
import re
from collections import Counter
from functools import lru_cache

WORD = re.compile(r"[a-z0-9]+")
NUMBER = re.compile(r"-?\d+")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term.
        b: the second term.
    """
    return a + b


def search(query: str, extra_info: dict) -> str:
    """Search the encyclopedia for passages about a topic.

    Args:
        query: what to look for, e.g. "capital of Norway".
    """
    return "\n".join(bm25_index(extra_info["corpus"]).top(query, k=2))


TOOLS = [multiply, add, search]


async def step(state: str, action: str, extra_info: dict) -> dict:
    answer = str(extra_info["answer"])
    if NUMBER.fullmatch(answer):
        written = NUMBER.findall(action.replace(",", ""))
        correct = bool(written) and written[-1] == answer
    else:
        correct = answer.lower() in action.lower()
    return {"reward": float(correct), "done": True}


class BM25:
    """Okapi BM25 (k1 = 1.5, b = 0.75) over a list of passages, words lower-cased."""

    def __init__(self, passages: list[str], k1: float = 1.5, b: float = 0.75):
        self.passages, self.k1, self.b = passages, k1, b
        self.counts = [Counter(WORD.findall(p.lower())) for p in passages]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.mean_length = sum(self.lengths) / max(len(passages), 1)
        document_frequency = Counter(word for counts in self.counts for word in counts)
        n = len(passages)
        self.idf = {w: math.log(1 + (n - df + 0.5) / (df + 0.5)) for w, df in document_frequency.items()}

    def score(self, query_words: list[str], i: int) -> float:
        counts, norm = self.counts[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.mean_length)
        return sum(self.idf.get(w, 0.0) * counts[w] * (self.k1 + 1) / (counts[w] + norm) for w in query_words)

    def top(self, query: str, k: int) -> list[str]:
        words = WORD.findall(query.lower())
        ranked = sorted(range(len(self.passages)), key=lambda i: -self.score(words, i))
        return [self.passages[i] for i in ranked[:k]]


@lru_cache(maxsize=4)
def bm25_index(corpus_path: str) -> BM25:
    """The index of a JSONL corpus (one {"text": ...} per line), built once per file."""
    with open(corpus_path) as f:
        return BM25([json.loads(line)["text"] for line in f if line.strip()])
