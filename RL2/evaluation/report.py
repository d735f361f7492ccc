"""What an evaluation reports: a record of every sample, and a table of the metrics."""

from RL2.rollout.metrics import COUNTS, reward_parts
from RL2.rollout.trajectory import Trajectory


def sample_records(groups: list[list[Trajectory]], prompts: list[dict], sources: list[str], role: str, model: str,
                   threshold: float) -> list[dict]:
    """One JSON-able record per sample of `groups` (those of each of `prompts`); `role` is "model" or "compare"."""
    records = []
    for index, (group, row, source) in enumerate(zip(groups, prompts, sources, strict=True)):
        for sample, t in enumerate(group):
            records.append({
                "model": model, "role": role, "data_source": source, "prompt_index": index, "row": row.get("row"),
                "sample_index": sample, "prompt": t.prompt_text, "response": t.response_text, "reward": t.reward,
                "score": t.score, "passed": t.score >= threshold, "parts": reward_parts(t),
                "response_length": t.response_length, "finish_reason": t.finish_reason, "n_turns": t.n_turns,
                "fault": t.fault, "extra_info": row["extra_info"],
            })
    return records


def format_table(columns: dict[str, dict], difference: dict | None = None) -> str:
    """A table with one row per (data source, metric), one column per model (`columns`: title -> metrics in
    the layout of `evaluation_metrics`), and `first - second` (`difference`, of the two columns, if two)."""
    titles = [*columns, *([" - ".join(columns)] if difference else [])]
    tables = [*columns.values(), *([difference] if difference else [])]
    rows = []
    for source in [*next(iter(columns.values()))["by_source"], "overall"]:
        per_column = [t["overall"] if source == "overall" else t["by_source"].get(source, {}) for t in tables]
        for i, name in enumerate(dict.fromkeys(name for metrics in per_column for name in metrics)):
            cells = [_number(name, m.get(name), signed=c == len(columns)) for c, m in enumerate(per_column)]
            rows.append([source if i == 0 else "", name, *cells])
    header = ["data_source", "metric", *titles]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]

    def line(row: list[str]) -> str:  # names to the left, numbers to the right
        return "  ".join(cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))

    return "\n".join(line(row).rstrip() for row in [header, *rows])


def _number(name: str, value, signed: bool = False) -> str:
    if value is None:
        return ""
    if name in (*COUNTS, "faults"):
        return f"{int(value):+d}" if signed else str(int(value))
    return f"{value:+.4f}" if signed else f"{value:.4f}"
