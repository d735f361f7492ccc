"""What a rollout is measured by and leaves behind: metrics per step, pass@k per data source, and
the JSONL dump of its samples."""

import json
import math
from collections import defaultdict
from pathlib import Path

from RL2.rollout.trajectory import Trajectory


def rollout_metrics(
    groups: list[list[Trajectory]], per_source: bool = False, k: int | None = None, pass_threshold: float = 1.0
) -> dict[str, float]:
    """Means over trajectories, namespaced `rollout/...`; with `per_source`, test metrics too.

    The environment's reward parts become `rollout/reward/<name>`: per trajectory the sum over its
    turns (like its reward), averaged over every trajectory, those without the part counting 0, so
    that a weighted sum of parts averages to the weighted sum of their metrics.

    Args:
        groups: trajectories grouped by prompt.
        per_source: add `test/{data_source}/score` (mean) and `test/{data_source}/pass@{k}`,
            with `data_source` from each prompt's `extra_info` ("default" when absent).
        k: for pass@k; default the group size. Unbiased estimator of Chen et al. (2021).
        pass_threshold: a trajectory passes when its score is at least this.
    """
    trajectories = [t for group in groups for t in group]
    if not trajectories:
        return {}
    metrics = {
        "rollout/reward": _mean(t.reward for t in trajectories),
        "rollout/score": _mean(t.score for t in trajectories),
        "rollout/response_length": _mean(t.response_length for t in trajectories),
        "rollout/clip_ratio": _mean(t.finish_reason == "length" for t in trajectories),
        "rollout/n_turns": _mean(t.n_turns for t in trajectories),
        "rollout/faults": float(sum(t.fault is not None for t in trajectories)),
    }
    metrics |= _reward_part_metrics(trajectories)
    if per_source:
        metrics |= _source_metrics(groups, k, pass_threshold)
    return metrics


def save_samples(path: str | Path, groups: list[list[Trajectory]], step: int) -> None:
    """Append one JSON line per trajectory (prompt, response, reward, ...) for inspection."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for group_index, group in enumerate(groups):
            for t in group:
                record = {
                    "step": step,
                    "group": group_index,
                    "prompt": t.prompt_text,
                    "response": t.response_text,
                    "reward": t.reward,
                    "score": t.score,
                    "n_turns": t.n_turns,
                    "finish_reason": t.finish_reason,
                    "stop_reason": t.stop_reason,
                    "fault": t.fault,
                }
                parts = reward_parts(t)
                if parts:
                    record["reward_parts"] = parts
                f.write(json.dumps(record, ensure_ascii=False) + "\n")


def reward_parts(trajectory: Trajectory) -> dict[str, float]:
    """A trajectory's reward parts, each summed over its turns."""
    parts: dict[str, float] = {}
    for turn in trajectory.turns:
        for name, value in turn.reward_parts.items():
            parts[name] = parts.get(name, 0.0) + value
    return parts


def _reward_part_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    per_trajectory = [reward_parts(t) for t in trajectories]
    names = sorted({name for parts in per_trajectory for name in parts})
    return {f"rollout/reward/{name}": _mean(parts.get(name, 0.0) for parts in per_trajectory) for name in names}


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)


def _source_metrics(groups: list[list[Trajectory]], k: int | None, pass_threshold: float) -> dict[str, float]:
    by_source = defaultdict(list)
    for group in groups:
        if group:
            by_source[group[0].extra_info.get("data_source", "default")].append(group)
    metrics = {}
    for source, source_groups in by_source.items():
        size = min(len(g) for g in source_groups)
        group_k = k or size
        if group_k > size:
            raise ValueError(f"pass@{group_k} needs at least {group_k} responses per prompt; {source} has {size}")
        passes = [pass_at_k(len(g), sum(t.score >= pass_threshold for t in g), group_k) for g in source_groups]
        metrics[f"test/{source}/score"] = _mean(t.score for g in source_groups for t in g)
        metrics[f"test/{source}/pass@{group_k}"] = _mean(passes)
    return metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k of the n samples (c of them correct) is correct."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
