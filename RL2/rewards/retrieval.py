"""A small local retriever: Okapi BM25 over a JSONL corpus (`{"text": ...}`, or Search-R1's `{"contents":
"title\\ntext"}` a line), for environments whose policy searches (envs/tool_use.py, envs/searchr1.py).

`python -m RL2.rewards.retrieval corpus.jsonl --port 10000 --top_k 3` serves the original RL2's search protocol on
localhost, `POST /search {"query": q} -> {"passage": "Doc 1(Title: ...) ..."}` and `GET /health`, as its
envs/local_search_service.py did with a dense index (e5 and faiss)."""

import argparse
import json
import math
import re
from collections import Counter
from functools import lru_cache

WORD = re.compile(r"[a-z0-9]+")


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
    """The index of a JSONL corpus (each line's "text", or Search-R1's "contents"), built once per file."""
    with open(corpus_path) as f:  # one parsed row at a time: only the passages stay
        rows = (json.loads(line) for line in f if line.strip())
        return BM25([row["text"] if "text" in row else row["contents"] for row in rows])


def search_r1_passages(corpus_path: str, query: str, k: int = 3) -> str:
    """The top `k` passages for `query` as Search-R1's retriever writes them: `Doc i(Title: title) text`,
    one a line (the first line of a passage of several is its title; a one-line passage has none)."""
    found = []
    for i, passage in enumerate(bm25_index(corpus_path).top(query, k), start=1):
        title, _, text = passage.partition("\n") if "\n" in passage else ("", "", passage)
        found.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(found)


def search_app(corpus_path: str, k: int):
    """An aiohttp application serving the original RL2's search protocol over `corpus_path`."""
    from aiohttp import web

    bm25_index(corpus_path)  # built before the first request

    async def search(request: web.Request) -> web.Response:
        query = (await request.json())["query"]
        return web.json_response({"passage": search_r1_passages(corpus_path, query, k)})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.add_routes([web.post("/search", search), web.get("/health", health)])
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus_path", help="JSONL corpus: {\"text\": ...} or {\"contents\": \"title\\ntext\"} a line")
    parser.add_argument("--port", type=int, default=10000, help="the original's envs/searchr1.py asks port 10000")
    parser.add_argument("--top_k", type=int, default=3, help="passages per query")
    args = parser.parse_args(argv)
    from aiohttp import web

    web.run_app(search_app(args.corpus_path, args.top_k), host="localhost", port=args.port)


if __name__ == "__main__":
    main()
