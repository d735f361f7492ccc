"""A run's samples.jsonl and metrics.jsonl, indexed for the viewer's queries: of each line, what the list and its
filters need (step, group, reward, lengths, faults, source, the text to search) and where it starts; a trajectory's
whole line, with its per-token columns, is read again when it is opened."""

import json
import mmap
import os
import threading
from pathlib import Path

# `save_samples` writes the per-token columns as a line's last key, so a line's summary is parsed without them: no
# other `, "tokens": ` can sit outside a JSON string, where every `"` follows a backslash.
TOKENS_KEY = b', "tokens": '
SNIPPET = 160  # characters of a response the list shows
# Keys of a summary row, besides `id`, `snippet` and `has_tokens`.
SUMMARY = ("step", "group", "reward", "score", "n_turns", "finish_reason", "stop_reason", "fault", "data_source",
           "response_length", "n_sequences", "tool_calls", "tool_errors", "parse_errors")


class Run:
    """The records of one save_dir, refreshed from its files on every `refresh` (a running job appends)."""

    def __init__(self, save_dir: str | Path):
        self.save_dir = Path(save_dir)
        self.samples_path = self.save_dir / "samples.jsonl"
        self.metrics_path = self.save_dir / "metrics.jsonl"
        self._lock = threading.Lock()
        self._file_id, self._read_to = None, 0
        self.rows: list[dict] = []  # summaries, `id` = position
        self._spans: list[tuple[int, int]] = []  # (start, end) of each line in samples.jsonl
        self._texts: list[str] = []  # lower-cased prompt and response of each row, for search
        self._by_prompt: dict[str, list[int]] = {}
        self._metrics_key, self._metrics = None, []
        self.refresh()

    # ---- reading the files ----

    def refresh(self) -> None:
        """Index the lines appended since the last call; start over when the file was rewritten (a resumed run
        drops the steps it redoes)."""
        with self._lock:
            try:
                stat = os.stat(self.samples_path)
            except FileNotFoundError:
                self._reset(None)
                return
            if self._file_id != stat.st_ino or stat.st_size < self._read_to:
                self._reset(stat.st_ino)
            if stat.st_size > self._read_to:
                self._index(stat.st_size)

    def _reset(self, file_id) -> None:
        self._file_id, self._read_to = file_id, 0
        self.rows, self._spans, self._texts, self._by_prompt = [], [], [], {}

    def _index(self, size: int) -> None:
        with open(self.samples_path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as data:
            start = self._read_to
            while start < size:
                end = data.find(b"\n", start, size)
                if end < 0:  # a line still being written: read it next time
                    break
                cut = data.find(TOKENS_KEY, start, end)
                head = data[start:cut] + b"}" if cut >= 0 else data[start:end]
                self._add(head, (start, end), has_tokens=cut >= 0)
                start = end + 1
            self._read_to = start

    def _add(self, head: bytes, span: tuple[int, int], has_tokens: bool) -> None:
        try:
            record = json.loads(head)
        except ValueError:  # a line an interrupted run left half-written
            return
        if not isinstance(record, dict) or "step" not in record:
            return
        row = {"id": len(self.rows)} | {key: record.get(key) for key in SUMMARY}
        response = record.get("response") or ""
        if row["n_sequences"] is None:
            row["n_sequences"] = 1
        row["snippet"], row["has_tokens"] = response[:SNIPPET], has_tokens
        self.rows.append(row)
        self._spans.append(span)
        prompt = record.get("prompt") or ""
        self._texts.append(f"{prompt}\n{response}".lower())
        self._by_prompt.setdefault(prompt, []).append(row["id"])

    def metrics(self) -> list[dict]:
        """The records of metrics.jsonl (whole lines only), read again when the file changed."""
        try:
            stat = os.stat(self.metrics_path)
        except FileNotFoundError:
            return []
        key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key != self._metrics_key:
            records = []
            for line in self.metrics_path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "step" in record:
                    records.append(record)
            self._metrics_key, self._metrics = key, records
        return self._metrics

    def sample(self, index: int) -> dict | None:
        """The whole record of row `index` (its tokens included), or None."""
        if not 0 <= index < len(self._spans):
            return None
        start, end = self._spans[index]
        with open(self.samples_path, "rb") as f:
            f.seek(start)
            record = json.loads(f.read(end - start))
        return {"id": index} | record

    # ---- queries ----

    def status(self) -> dict:
        return {"save_dir": str(self.save_dir), "n_samples": len(self.rows), "n_metrics": len(self.metrics()),
                "sources": sorted({r["data_source"] for r in self.rows if r["data_source"] is not None}),
                "steps": sorted({r["step"] for r in self.rows})}

    def steps(self) -> list[dict]:
        """Per step: its trajectories' count, mean, min and max reward, faults, mean response length."""
        by_step: dict[int, list[dict]] = {}
        for row in self.rows:
            by_step.setdefault(row["step"], []).append(row)
        table = []
        for step in sorted(by_step):
            rows = by_step[step]
            rewards = [r["reward"] or 0.0 for r in rows]
            lengths = [r["response_length"] for r in rows if r["response_length"] is not None]
            table.append({"step": step, "n": len(rows), "reward": sum(rewards) / len(rows), "reward_min": min(rewards),
                          "reward_max": max(rewards), "faults": sum(r["fault"] is not None for r in rows),
                          "length": sum(lengths) / len(lengths) if lengths else None})
        return table

    def query(self, filters: dict, offset: int, limit: int) -> dict:
        """The rows that pass every filter given (absent or empty ones pass all), `limit` of them from `offset`, and
        how many pass.

        Args:
            filters: `step` (int), `min_reward` / `max_reward` (float), `fault` ("yes" | "no"), `source`,
                `tool_errors` (true: at least one failed tool call or unparsed call), `split` (true: the environment
                started more than one sequence), `q` (text in the prompt or response, any case).
        """
        step, source, fault = filters.get("step"), filters.get("source"), filters.get("fault")
        low, high = filters.get("min_reward"), filters.get("max_reward")
        needle = (filters.get("q") or "").lower()
        tool_errors, split = filters.get("tool_errors"), filters.get("split")
        ids = []
        with self._lock:
            for row, text in zip(self.rows, self._texts):
                reward = row["reward"] or 0.0
                if ((step is not None and row["step"] != step) or (low is not None and reward < low)
                        or (high is not None and reward > high) or (source and row["data_source"] != source)
                        or (fault == "yes" and row["fault"] is None) or (fault == "no" and row["fault"] is not None)
                        or (tool_errors and not ((row["tool_errors"] or 0) + (row["parse_errors"] or 0)))
                        or (split and (row["n_sequences"] or 1) < 2) or (needle and needle not in text)):
                    continue
                ids.append(row["id"])
            return {"total": len(ids), "offset": offset, "rows": [self.rows[i] for i in ids[offset:offset + limit]]}

    def group(self, step: int, group: int) -> list[dict]:
        """The whole records of one GRPO group: the trajectories of one prompt at one step."""
        return [self.sample(r["id"]) for r in self.rows if r["step"] == step and r["group"] == group]

    def same_prompt(self, index: int) -> list[dict]:
        """The rows of every trajectory of row `index`'s prompt, at any step."""
        record = self.sample(index)
        if record is None:
            return []
        return [self.rows[i] for i in self._by_prompt.get(record.get("prompt") or "", [])]
