"""The learning curve of a run: train reward and test scores against step, from its metrics.jsonl."""

import json
from pathlib import Path

from RL2.utils.logging import log_rank0

TRAIN_KEYS = ("rollout/reward", "rollout/score")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_learning_curve(save_dir: str, filename: str = "learning_curve.png") -> Path | None:
    """Write `<save_dir>/<filename>`: the train reward/score and every `test/.../score` (accuracy
    for 0/1 scores) against step. Returns the path, or None when there is nothing to plot."""
    metrics_path = Path(save_dir) / "metrics.jsonl"
    if not metrics_path.exists():
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        log_rank0("matplotlib is not installed: no learning-curve plot (pip install matplotlib)")
        return None
    rows = read_metrics(metrics_path)
    test_keys = sorted({k for row in rows for k in row if k.startswith("test/") and k.endswith("score")})
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in [*TRAIN_KEYS, *test_keys]:
        points = [(row["step"], row[key]) for row in rows if key in row]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if key.startswith("test/") else None, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / score")
    ax.set_title(Path(save_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(save_dir) / filename
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
