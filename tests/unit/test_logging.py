import json
import os

import pytest

from RL2.config import ConfigError
from RL2.utils.logging import MetricsSink, read_jsonl


def test_jsonl_records_and_resume_truncation(tmp_path):
    sink = MetricsSink(str(tmp_path))
    for step in (1, 2, 3):
        sink.log({"train/loss": 1.0 / step}, step)
    sink.truncate_after(2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "train/loss": 1.0}, {"step": 2, "train/loss": 0.5}]


def test_resume_drops_a_line_torn_by_a_crash(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n{"step": 2, "train/loss": 0.5}\n'
                                            '{"step": 3, "train/lo')
    sink = MetricsSink(str(tmp_path))
    sink.truncate_after(2)
    sink.log({"train/loss": 0.25}, 3)
    assert (tmp_path / "metrics.jsonl").read_text() == ('{"step": 1, "train/loss": 1.0}\n'
                                                        '{"step": 2, "train/loss": 0.5}\n'
                                                        '{"step": 3, "train/loss": 0.25}\n')


def test_resume_rewrites_metrics_in_one_rename(tmp_path, monkeypatch):
    original = '{"step": 1, "train/loss": 1.0}\n{"step": 2, "train/loss": 0.5}\n'
    (tmp_path / "metrics.jsonl").write_text(original)
    sink = MetricsSink(str(tmp_path))

    def crash(*args):
        raise KeyboardInterrupt  # the process dies just before the new file takes the old one's place

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        sink.truncate_after(1)
    assert (tmp_path / "metrics.jsonl").read_text() == original
    monkeypatch.undo()
    sink.truncate_after(1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "train/loss": 1.0}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left


def test_wandb_without_login_runs_offline(tmp_path, monkeypatch):
    for key in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    sink = MetricsSink(str(tmp_path), use_wandb=True, project="p", name="n")
    sink.log({"train/loss": 1.5}, 1)
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))  # logged offline instead of prompting


def test_a_new_run_after_a_killed_one_logs_on_lines_of_its_own(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n{"step": 2, "train/lo')
    MetricsSink(str(tmp_path)).log({"train/loss": 0.5}, 1)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[-2:] == ['{"step": 2, "train/lo',
                                                                        '{"step": 1, "train/loss": 0.5}']
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "train/loss": 1.0}, {"step": 1, "train/loss": 0.5}]


def test_wandb_asked_for_but_not_installed_stops_at_start_naming_the_key(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"trainer\.use_wandb=true needs the wandb package: run `pip install wandb`"):
        MetricsSink(str(tmp_path), use_wandb=True)


def test_wandb_disabled_by_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = MetricsSink(str(tmp_path), use_wandb=True)
    assert sink.wandb is None
    sink.log({"a": 1}, 1)
    assert (tmp_path / "metrics.jsonl").exists()


def test_checkpoint_named_by_folder_or_path(tmp_path, monkeypatch):
    import pytest

    from RL2.utils.checkpoint import COMPLETE, resolve_checkpoint

    for step in (2, 4):
        (tmp_path / f"step{step}").mkdir()
        (tmp_path / f"step{step}" / COMPLETE).write_text("{}")
    (tmp_path / "step6").mkdir()  # a save that did not finish
    monkeypatch.chdir(tmp_path.parent)  # the folder name alone is not a path from here
    assert resolve_checkpoint("latest", str(tmp_path)) == tmp_path / "step4"
    assert resolve_checkpoint("step2", str(tmp_path)) == tmp_path / "step2"
    assert resolve_checkpoint(str(tmp_path / "step2"), "elsewhere") == tmp_path / "step2"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_checkpoint("step6", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"neither step9 nor .*step9 exists; give 'latest' or a step<N> folder"):
        resolve_checkpoint("step9", str(tmp_path))
