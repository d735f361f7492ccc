"""Learning curves: every trainer draws the metrics it chose, exactly as metrics.jsonl has them, into
a valid, non-blank `learning_curve.png`, replaced atomically. The same runs write TensorBoard's event
files (where tensorboard is installed), checked against metrics.jsonl too."""

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from RL2.utils.plot import CurvePanel, curve_series, draw_learning_curve, plot_learning_curve
from tests.helpers.launch import REPO, read_metrics, run_ranks
from tests.helpers.tensorboard import HAVE_TENSORBOARD, TENSORBOARD_IF_INSTALLED, assert_tensorboard_equals_jsonl
from tests.helpers.tiny import make_tiny_model

# matplotlib's first three default line colours (tab:blue, tab:orange, tab:green): one per metric of a
# panel, train and test of a metric sharing theirs.
LINE_COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44)]

# What each trainer's curve must show, panel by panel, written out here rather than read from the
# trainers: a change to a trainer's curve has to change this table too.
EXPECTED_PANELS = {
    "sft": [["train/loss", "test/loss"]],
    "distill": [["train/loss", "test/loss"]],
    "dpo": [["train/loss", "test/loss"], ["train/accuracy", "test/accuracy"], ["train/margin", "test/margin"]],
    "rm": [["train/loss", "test/loss"], ["train/accuracy", "test/accuracy"], ["train/margin", "test/margin"]],
    "orpo": [["train/loss", "test/loss", "train/nll", "test/nll"], ["train/accuracy", "test/accuracy"],
             ["train/log_odds", "test/log_odds"]],
    "ppo": [["rollout/reward", "rollout/score", "test/emit/score"],
            ["rollout/response_length", "test/response_length"]],
}
# The most colours one panel uses: ORPO's loss and nll, PPO's reward, score and per-source test score.
EXPECTED_COLOURS = {"sft": 1, "distill": 1, "dpo": 1, "rm": 1, "orpo": 2, "ppo": 3}


def colour_counts(path: Path) -> dict[tuple[int, int, int], int]:
    image = Image.open(path).convert("RGB")
    return {colour: count for count, colour in image.getcolors(maxcolors=image.width * image.height)}


def assert_valid_curve_png(path: Path, n_panels: int, n_colours: int) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()  # a complete, uncorrupted file
    with Image.open(path) as image:
        assert image.size == (500 * n_panels, 380)  # 5 x 3.8 inches per panel at 100 dpi
    counts = colour_counts(path)
    total = sum(counts.values())
    assert counts.get((255, 255, 255), 0) < 0.97 * total  # not blank
    for colour in LINE_COLOURS[:n_colours]:
        assert counts.get(colour, 0) > 30, f"no line drawn in {colour}"


# --- the plotting functions -------------------------------------------------------------------------


def test_curve_series_picks_each_panels_metrics():
    rows = [
        {"step": 0, "test/a/score": 0.25, "test/b/score": 0.5, "test/loss": 3.0},
        {"step": 1, "train/loss": 2.0, "train/lr": 1e-3, "note": "text"},
        {"step": 2, "train/loss": 1.5, "train/lr": 1e-3, "test/a/score": 0.75, "test/b/score": math.nan},
    ]
    panels = (
        CurvePanel("loss", ("train/loss", "test/loss")),
        CurvePanel("score", ("test/*/score", "test/a/score")),  # test/a/score matches twice: once only
        CurvePanel("nothing logged", ("train/accuracy",)),  # left out
        CurvePanel("text", ("note",)),  # not a number: left out
    )
    assert curve_series(rows, panels) == [
        (panels[0], {"train/loss": ([1, 2], [2.0, 1.5]), "test/loss": ([0], [3.0])}),
        (panels[1], {"test/a/score": ([0, 2], [0.25, 0.75]), "test/b/score": ([0], [0.5])}),
    ]


def test_png_holds_every_line(tmp_path):
    panels = [
        (CurvePanel("loss", ("train/loss", "test/loss", "train/nll")),
         {"train/loss": ([1, 2, 3, 4], [2.0, 1.5, 1.2, 1.0]), "test/loss": ([0, 2, 4], [2.1, 1.6, 1.1]),
          "train/nll": ([1, 2, 3, 4], [1.8, 1.4, 1.1, 0.9])}),
        (CurvePanel("accuracy", ("train/accuracy",), ylim=(0, 1)),
         {"train/accuracy": ([1, 2, 3, 4], [0.5, 0.6, 0.8, 0.9])}),
    ]
    path = tmp_path / "curve.png"
    draw_learning_curve(panels, path, "demo")
    assert_valid_curve_png(path, n_panels=2, n_colours=2)
    assert [p.name for p in tmp_path.iterdir()] == ["curve.png"]  # no temporary file left


def test_png_is_replaced_only_when_complete(tmp_path, monkeypatch):
    import matplotlib.figure

    path = tmp_path / "learning_curve.png"
    path.write_bytes(b"the previous curve")
    panels = [(CurvePanel("loss", ("train/loss",)), {"train/loss": ([1, 2], [2.0, 1.0])})]

    def crash_midway(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        draw_learning_curve(panels, path, "demo")
    assert path.read_bytes() == b"the previous curve"
    assert [p.name for p in tmp_path.iterdir()] == ["learning_curve.png"]
    monkeypatch.undo()
    draw_learning_curve(panels, path, "demo")
    assert_valid_curve_png(path, n_panels=1, n_colours=1)


def test_nothing_to_plot_writes_nothing(tmp_path):
    assert plot_learning_curve(str(tmp_path), (CurvePanel("loss", ("train/loss",)),)) is None  # no metrics.jsonl
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "perf/step_s": 0.5}) + "\n")
    assert plot_learning_curve(str(tmp_path), (CurvePanel("loss", ("train/loss",)),)) is None
    assert not (tmp_path / "learning_curve.png").exists()


# --- every trainer ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("curve_data")
    words = ["apple", "river", "stone", "cloud", "green", "seven"]
    pairs = [{"prompt": f"Question {i}: {words[i % 6]}?", "chosen": f"{words[i % 6]} good",
              "rejected": f"{words[i % 6]} bad"} for i in range(12)]
    sft = [{"prompt": f"Count to {n}.", "response": " ".join(str(i) for i in range(1, n + 1))} for n in range(1, 13)]
    rl = [{"prompt": f"question {k}", "extra_info": {"data_source": "emit"}} for k in range(12)]
    paths = {}
    for name, rows in (("pairs", pairs), ("sft", sft), ("rl", rl)):
        for split, part in (("train", rows[:8]), ("test", rows[8:])):
            paths[f"{name}_{split}"] = folder / f"{name}_{split}.jsonl"
            paths[f"{name}_{split}"].write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def trainer_args(kind: str, model: str, teacher: str, data: dict[str, Path], save_dir: Path) -> list[str]:
    section = "critic" if kind == "rm" else "actor"
    rows = {"sft": "sft", "distill": "sft", "ppo": "rl"}.get(kind, "pairs")
    args = [f"data.train.path={data[rows + '_train']}", f"data.test.path={data[rows + '_test']}",
            "data.train.batch_size=4", f"{section}.model_name={model}", f"{section}.dtype=float32",
            f"{section}.optimizer.lr=1e-3", f"{section}.max_length_per_device=512", f"trainer.save_dir={save_dir}",
            "trainer.total_steps=3", "trainer.test_freq=2", *TENSORBOARD_IF_INSTALLED]
    if kind == "distill":
        args.append(f"actor.teacher_name={teacher}")
    if kind == "ppo":
        args += [f"rollout.env_path={REPO / 'tests' / 'envs' / 'emit_token.py'}", "rollout.responses_per_prompt=2",
                 "rollout.train_sampling_params.max_new_tokens=4", "rollout.test_sampling_params.max_new_tokens=4"]
    return args


@pytest.mark.parametrize("kind", ["sft", "dpo", "ppo",
                                  # the same code as sft's and dpo's with other panels: in the slow run only
                                  pytest.param("orpo", marks=pytest.mark.slow),
                                  pytest.param("distill", marks=pytest.mark.slow),
                                  pytest.param("rm", marks=pytest.mark.slow)])
def test_every_trainer_draws_its_metrics(kind, tiny_model_path, data, tmp_path, tmp_path_factory):
    teacher = make_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1) if kind == "distill" else ""
    save_dir, record = tmp_path / "run", tmp_path / "curve_calls.jsonl"
    run_ranks(1, ["tests/e2e/scripts/record_learning_curve.py", str(record), kind,
                  *trainer_args(kind, tiny_model_path, teacher, data, save_dir)])
    (call,) = [json.loads(line) for line in record.read_text().splitlines()]  # once, at the end of the run
    assert call["path"] == str(save_dir / "learning_curve.png")
    rows = read_metrics(save_dir)
    drawn = [panel["series"] for panel in call["panels"]]
    assert [list(series) for series in drawn] == EXPECTED_PANELS[kind]
    for series in drawn:
        for key, (steps, values) in series.items():
            assert [steps, values] == [[r["step"] for r in rows if key in r], [r[key] for r in rows if key in r]]
            assert steps == ([0, 2, 3] if key.startswith("test/") else [1, 2, 3])
    assert_valid_curve_png(save_dir / "learning_curve.png", n_panels=len(drawn), n_colours=EXPECTED_COLOURS[kind])
    if HAVE_TENSORBOARD:  # (in RL2[test]; without it only this check is left out)
        assert_tensorboard_equals_jsonl(save_dir)
