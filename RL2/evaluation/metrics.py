"""What an evaluation reports, per data source and over all prompts, and the difference of two models.

Per sample (one trajectory): its score (summed over turns, as the environment returned it), whether
it passes (score >= the threshold), its sampled tokens. Per group of prompts:

- `accuracy`: the share of samples that pass;
- `score`, `reward`: mean over samples;
- `pass@k`: mean over prompts of the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k)
  with n samples of which c pass;
- `response_length`: mean sampled tokens per sample; `truncated`: share cut at max_new_tokens;
- `faults`: samples ended by a failing environment or reward (scored 0);
- `reward/<name>`: mean of each reward part (0 where a sample has none);
- `n_prompts`, `n_samples`.
"""

from collections import defaultdict

from RL2.rollout.metrics import pass_at_k, reward_parts
from RL2.rollout.trajectory import Trajectory

COUNTS = ("n_prompts", "n_samples")  # sizes, not measurements: no difference is taken


def evaluation_metrics(groups: list[list[Trajectory]], sources: list[str], ks: list[int], threshold: float) -> dict:
    """`{"overall": metrics, "by_source": {source: metrics}}` of one model's samples.

    Args:
        groups: the samples of each prompt.
        sources: each prompt's `data_source`.
        ks: pass@k for each k (at most the samples of any prompt).
        threshold: a sample passes when its score is at least this.
    """
    by_source = defaultdict(list)
    for source, group in zip(sources, groups, strict=True):
        by_source[source].append(group)
    return {
        "overall": group_metrics(groups, ks, threshold),
        "by_source": {source: group_metrics(by_source[source], ks, threshold) for source in sorted(by_source)},
    }


def group_metrics(groups: list[list[Trajectory]], ks: list[int], threshold: float) -> dict[str, float]:
    """The metrics of the module docstring over `groups` (the samples of each prompt)."""
    samples = [t for group in groups for t in group]
    metrics = {
        "n_prompts": len(groups),
        "n_samples": len(samples),
        "accuracy": _mean(t.score >= threshold for t in samples),
        "score": _mean(t.score for t in samples),
        "reward": _mean(t.reward for t in samples),
    }
    for k in ks:
        metrics[f"pass@{k}"] = _mean(pass_at_k(len(g), sum(t.score >= threshold for t in g), k) for g in groups)
    metrics["response_length"] = _mean(t.response_length for t in samples)
    metrics["truncated"] = _mean(t.finish_reason == "length" for t in samples)
    metrics["faults"] = sum(t.fault is not None for t in samples)
    parts = [reward_parts(t) for t in samples]
    for name in sorted({name for p in parts for name in p}):
        metrics[f"reward/{name}"] = _mean(p.get(name, 0.0) for p in parts)
    return metrics


def metrics_difference(first: dict, second: dict) -> dict:
    """`first - second` for every measurement both have, in the layout of `evaluation_metrics`."""

    def minus(a: dict, b: dict) -> dict[str, float]:
        return {key: a[key] - b[key] for key in a if key in b and key not in COUNTS}

    sources = [s for s in first["by_source"] if s in second["by_source"]]
    return {"overall": minus(first["overall"], second["overall"]),
            "by_source": {s: minus(first["by_source"][s], second["by_source"][s]) for s in sources}}


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0
