"""Learning curves: the metrics a trainer chooses (its `CurvePanel`s), against step, from its metrics.jsonl,
as one PNG (docs/outputs.md)."""

import importlib.util
import math
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from RL2.utils.logging import log_rank0, read_jsonl

Series = tuple[list[int], list[float]]  # (steps, values)


@dataclass(frozen=True)
class CurvePanel:
    """One subplot of a learning curve."""

    title: str  # what the panel shows; also its y-axis label unless `ylabel` is given
    keys: tuple[str, ...]  # metric names or fnmatch patterns (`test/*/score`), plotted in this order
    ylabel: str | None = None
    ylim: tuple[float, float] | None = None  # fixed y-axis limits (accuracies: (0, 1)); None: the data decide


def curve_series(rows: list[dict], panels: tuple[CurvePanel, ...]) -> list[tuple[CurvePanel, dict[str, Series]]]:
    """The points of every panel: for each metric of `rows` (metrics.jsonl records) matching one of its
    keys, its (steps, values). Panels with no matching metric are left out; a metric matching two patterns
    of a panel is plotted once. Non-numeric values are skipped."""
    names = list(dict.fromkeys(k for row in rows for k in row if k != "step"))
    result = []
    for panel in panels:
        keys = list(dict.fromkeys(name for pattern in panel.keys for name in sorted(names)
                                  if fnmatchcase(name, pattern)))
        series = {}
        for key in keys:
            points = [(row["step"], float(row[key])) for row in rows if _is_number(row.get(key))]
            if points:
                steps, values = zip(*points)
                series[key] = (list(steps), list(values))
        if series:
            result.append((panel, series))
    return result


def draw_learning_curve(panels: list[tuple[CurvePanel, dict[str, Series]]], path: Path, title: str) -> None:
    """Draw the panels (`curve_series`) side by side and write them to `path` as a PNG, atomically."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels):
        # One colour per metric, solid for training and dashed with a dot per evaluation for test.
        metrics = list(dict.fromkeys(_metric_name(key) for key in series))
        for key, (steps, values) in series.items():
            test = key.startswith("test/")
            ax.plot(steps, values, color=colours[metrics.index(_metric_name(key)) % len(colours)],
                    linestyle="--" if test else "-", marker="o" if test or len(steps) == 1 else None,
                    markersize=4, label=key)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel or panel.title)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def plot_learning_curve(save_dir: str, panels: tuple[CurvePanel, ...], title: str | None = None) -> Path | None:
    """Write `<save_dir>/learning_curve.png` from `<save_dir>/metrics.jsonl`, titled `title` (default: the run
    folder's name). Returns its path, or None when there is nothing to plot."""
    metrics_path = Path(save_dir) / "metrics.jsonl"
    data = curve_series(read_jsonl(metrics_path), panels) if metrics_path.exists() else []
    if not data:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        log_rank0("matplotlib is not installed: no learning-curve plot (pip install matplotlib)")
        return None
    out = Path(save_dir) / "learning_curve.png"
    draw_learning_curve(data, out, title or Path(save_dir).name)
    return out


def _metric_name(key: str) -> str:
    """`train/loss` and `test/loss` are one metric, as are `rollout/response_length` and `test/response_length`."""
    split, _, name = key.partition("/")
    return name if split in ("train", "test", "rollout") and name else key


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
