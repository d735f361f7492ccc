"""What a rollout is measured by and leaves behind: metrics per step, an evaluation's per data source
(docs/evaluation.md), and the JSONL dump of its samples."""

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

from RL2.rollout.trajectory import Trajectory


def rollout_metrics(groups: list[list[Trajectory]], tools: bool = False) -> dict[str, float]:
    """Means over trajectories, namespaced `rollout/...`, with the reward parts' `rollout/reward/<name>`
    (docs/rewards.md); where the policy may call tools (`tools`), also `rollout/tool_*` (docs/agents.md)."""
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
        "rollout/split_turns": float(sum(t.split_turns for t in trajectories)),
    }
    metrics |= {f"rollout/faults/{kind}": float(n) for kind, n in fault_kinds(trajectories).items()}
    metrics |= _means_by_name([reward_parts(t) for t in trajectories], "rollout/reward/")
    metrics |= _means_by_name([t.metrics for t in trajectories], "rollout/agent/", only_given=True)
    metrics |= _means_by_name([t.agent_calls for t in trajectories if t.agent_calls], "rollout/agent_calls/")
    if tools:
        tool_s, generate_s = sum(t.tool_seconds for t in trajectories), sum(t.generate_seconds for t in trajectories)
        metrics |= {
            "rollout/tool_calls": _mean(t.tool_calls for t in trajectories),
            "rollout/tool_parse_errors": _mean(t.parse_errors for t in trajectories),
            "rollout/tool_errors": _mean(t.tool_errors for t in trajectories),
            "rollout/tool_s": _mean(t.tool_seconds for t in trajectories),
            "rollout/generate_s": _mean(t.generate_seconds for t in trajectories),
            "rollout/tool_time_share": tool_s / (tool_s + generate_s) if tool_s + generate_s > 0 else 0.0,
        }
    return metrics


def staleness_metrics(groups: list[list[Trajectory]], version: int, max_lag: int = 0) -> dict[str, float]:
    """How old the trained tokens of known version are, against the `version` of the weights trained (`staleness/...`,
    docs/async.md); the shares up to `max_lag` at least (`rollout.max_staleness`), so every step has the same keys."""
    trajectories = [t for group in groups for t in group]
    lags = [max(version - v, 0) for t in trajectories for v in t.versions]  # none is newer than the trained weights
    counts = Counter(lags)
    metrics = {f"staleness/lag_{k}": counts[k] / max(len(lags), 1) for k in range(max(lags + [max_lag]) + 1)}
    metrics["staleness/mean_lag"] = _mean(lags)
    metrics["staleness/max_span"] = float(max((max(t.versions) - min(t.versions) for t in trajectories if t.versions),
                                              default=0))
    return metrics


# A fault's kind, from the first marker its reason holds (the reasons RL2.rollout.loop, its tools and RL2.agents give);
# a judge's first, as its reason may tell of a timeout or an error of the judge's own.
FAULT_KINDS = {
    "judge": ("JudgeError",),
    "timeout": ("timed out", "did not return within"),
    "budget": ("rollout.agent_max_",),
    "malformed": ("malformed", "could not be parsed", "the state is text"),
    "tool": ("rollout.tool_error=end",),
    "no_call": ("made no model call",),
    "raised": ("raised", "reset failed"),
}


def fault_kinds(trajectories: list[Trajectory]) -> Counter:
    """How many of the trajectories each kind of fault ended (a key of FAULT_KINDS, "other" for none of them)."""
    kinds = Counter()
    for fault in (t.fault for t in trajectories if t.fault is not None):
        kind = next((kind for kind, markers in FAULT_KINDS.items() if any(m in fault for m in markers)), "other")
        kinds[kind] += 1
    return kinds


def fault_summary(groups: list[list[Trajectory]], outcome: str = "reward 0") -> str | None:
    """How many trajectories a failing environment ended (`outcome`: what became of them), with the first one's
    reason, for the log, where a `step` that fails on every action would otherwise go unexplained; None for none."""
    trajectories = [t for group in groups for t in group]
    faults = [t.fault for t in trajectories if t.fault is not None]
    if not faults:
        return None
    kinds = ", ".join(f"{kind} {n}" for kind, n in fault_kinds(trajectories).most_common())
    return (f"{len(faults)} of {len(trajectories)} trajectories ended by a fault ({outcome}; {kinds}), the first: "
            f"{faults[0]}")


def split_summary(groups: list[list[Trajectory]], template: str) -> str | None:
    """How many turns started a new sequence (`Trajectory.split_turns`), naming the tokenizer `template` whose chat
    template re-rendered the conversation other than as sampled; None when none did."""
    trajectories = [t for group in groups for t in group]
    splits = sum(t.split_turns for t in trajectories)
    if not splits:
        return None
    turns = sum(t.n_turns for t in trajectories)
    return (f"{splits} of {turns} turns started a new sequence, their next prompt not extending the tokens sampled "
            f"(the chat template of {template} re-rendered the conversation otherwise, or the environment's text "
            f"state changed; rollout/split_turns, docs/agents.md \"Token in, token out\")")


def save_samples(path: str | Path, groups: list[list[Trajectory]], step: int,
                 tokens: list[dict] | None = None, source: dict | None = None) -> None:
    """Append one JSON line per trajectory (prompt, response, reward, ...) for the viewer; `tokens`: per trajectory,
    its `sample_tokens` record, written last on its line (the viewer reads a line's other keys without parsing it);
    `source`: where the prompts came from (`data`, `script`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A lone surrogate ("\ud800") in a prompt or an observation is written as its JSON escape (UTF-8 has none).
    trajectories = iter(tokens or [])
    with open(path, "a", encoding="utf-8", errors="backslashreplace") as f:
        for group_index, group in enumerate(groups):
            for t in group:
                record = {"step": step, "group": group_index, "row": t.row, **(source or {}), "prompt": t.prompt_text,
                          "response": t.response_text, "reward": t.reward, "score": t.score, "n_turns": t.n_turns,
                          "finish_reason": t.finish_reason, "stop_reason": t.stop_reason, "fault": t.fault}
                if parts := reward_parts(t):
                    record["reward_parts"] = parts
                # What a viewer filters and draws by beyond the text: length, source, tools, each turn.
                record |= {"response_length": t.response_length, "n_sequences": len(t.sequences)}
                if "data_source" in (t.extra_info or {}):
                    record["data_source"] = str(t.extra_info["data_source"])
                if t.tool_calls or t.parse_errors:
                    record |= {"tool_calls": t.tool_calls, "tool_errors": t.tool_errors, "parse_errors": t.parse_errors}
                if t.n_turns > 1 or any(turn.env_text for turn in t.turns):
                    record["turns"] = [{"action": turn.action_text, "observation": turn.env_text, "reward": turn.reward,
                                        "finish_reason": turn.finish_reason} for turn in t.turns]
                if tokens:
                    record["tokens"] = next(trajectories)
                f.write(json.dumps(record, ensure_ascii=False) + "\n")


def reward_parts(trajectory: Trajectory) -> dict[str, float]:
    """A trajectory's reward parts, each summed over its turns."""
    parts = Counter()
    for turn in trajectory.turns:
        parts.update(turn.reward_parts)
    return dict(parts)


def _means_by_name(values: list[dict[str, float]], prefix: str, only_given: bool = False) -> dict[str, float]:
    """`prefix` + name: the mean of each name's values, a dict without it counting 0 (`only_given`: not at all)."""
    names = sorted({name for given in values for name in given})
    return {f"{prefix}{name}": _mean(given.get(name, 0.0) for given in values if name in given or not only_given)
            for name in names}


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k of n samples, c of them correct, is correct): Chen et al.'s (2021) unbiased estimator."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


COUNTS = ("n_prompts", "n_samples")  # sizes, not measurements: no difference is taken


def evaluation_metrics(groups: list[list[Trajectory]], sources: list[str], ks: list[int], threshold: float,
                       tools: bool = False) -> dict:
    """`{"overall": metrics, "by_source": {source: metrics}}` of one model's samples (`groups`, one per prompt;
    `sources`, their `data_source`): `group_metrics` with pass@k for each k of `ks`, passing at score >= `threshold`."""
    by_source = defaultdict(list)
    for source, group in zip(sources, groups, strict=True):
        by_source[source].append(group)
    return {
        "overall": group_metrics(groups, ks, threshold, tools),
        "by_source": {source: group_metrics(by_source[source], ks, threshold, tools) for source in sorted(by_source)},
    }


def group_metrics(groups: list[list[Trajectory]], ks: list[int], threshold: float,
                  tools: bool = False) -> dict[str, float]:
    """The evaluation metrics (docs/evaluation.md) over `groups` (the samples of each prompt)."""
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
    metrics |= _means_by_name([reward_parts(t) for t in samples], "reward/")
    if tools:
        metrics["tool_calls"] = _mean(t.tool_calls for t in samples)
        metrics["tool_errors"] = _mean(t.tool_errors for t in samples)
    return metrics


def metrics_difference(first: dict, second: dict) -> dict:
    """`first - second` for every measurement both have, in the layout of `evaluation_metrics`."""

    def minus(a: dict, b: dict) -> dict[str, float]:
        return {key: a[key] - b[key] for key in a if key in b and key not in COUNTS}

    sources = [s for s in first["by_source"] if s in second["by_source"]]
    return {"overall": minus(first["overall"], second["overall"]),
            "by_source": {s: minus(first["by_source"][s], second["by_source"][s]) for s in sources}}
