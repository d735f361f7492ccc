"""The Python API (`RL2.train`, `RL2.evaluate`): overrides parse exactly as the command line they stand
for, with its errors and RL2's original key names; a Python reward function is what scores the
rollouts; a plain Python process trains and evaluates; and the example of docs/python-api.md runs as written."""

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import RL2
from RL2.api import build_config, override_args
from RL2.config import ConfigError, parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.config.schema import SFTConfig
from RL2.rollout.env import EnvError
from tests.helpers import SCRIPTS
from tests.helpers.launch import REPO, read_metrics, run_ranks
from tests.helpers.threads_at_exit import group_threads_at_exit, record_threads_at_exit

README_MODEL_LINE = 'MODEL = "smollm2-135m-instruct"  # the bundled default; any Hugging Face folder works'


def plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


# ---- overrides are a command line -----------------------------------------------------------------


def test_nested_and_dotted_overrides_parse_like_the_command_line():
    overrides = {"data": {"train": {"path": "my data.jsonl", "batch_size": 4}}, "actor.optimizer.lr": 3e-6,
                 "actor": {"optimizer": {"betas": [0.9, 0.95]}, "max_grad_norm": 0},
                 "rollout.server_args": {"tp_size": 2}, "trainer.total_steps": None, "rollout.reward_fn": "x.py:f"}
    argv = ["data.train.path=my data.jsonl", "data.train.batch_size=4", "actor.optimizer.lr=3e-6",
            "actor.optimizer.betas=[0.9,0.95]", "actor.max_grad_norm=0", "rollout.server_args.tp_size=2",
            "trainer.total_steps=null", "rollout.reward_fn=x.py:f"]
    assert plain(build_config("ppo", overrides)) == plain(parse_config(PPOConfig, "ppo", argv))
    assert plain(build_config("ppo", overrides)) != plain(parse_config(PPOConfig, "ppo", argv[:-1]))


@pytest.mark.parametrize("text", ["1e3", "null", "true", "it's \"quoted\"", "a=b:c, [d]", "", "日本"])
def test_a_string_stays_that_string(text):
    assert build_config("sft", {"trainer.experiment_name": text}).trainer.experiment_name == text


def test_interpolations_and_paths_work_as_on_the_command_line(tmp_path):
    cfg = build_config("sft", {"trainer": {"experiment_name": "x", "save_dir": "runs/${trainer.experiment_name}"},
                               "data.train.path": tmp_path / "d.jsonl"})
    assert cfg.trainer.save_dir == "runs/x" and cfg.data.train.path == str(tmp_path / "d.jsonl")


def test_a_dataclass_of_overrides():
    @dataclasses.dataclass
    class Optimizer:
        lr: float = 2e-5

    @dataclasses.dataclass
    class Actor:
        optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
        dtype: str = "float32"

    @dataclasses.dataclass
    class Run:
        actor: Actor = dataclasses.field(default_factory=Actor)

    assert plain(build_config("sft", Run())) == plain(parse_config(
        SFTConfig, "sft", ["actor.optimizer.lr=2e-5", "actor.dtype=float32"]))
    # The schema itself works too: every key set (the YAML's values give way to the schema's defaults).
    assert plain(build_config("sft", SFTConfig())) == plain(OmegaConf.structured(SFTConfig))


def test_original_keys_and_errors_are_the_command_lines(capsys):
    cfg = build_config("ppo", {"train_data": {"path": "rl.jsonl"}, "actor.lr": 1e-6})
    assert cfg.data.train.path == "rl.jsonl" and cfg.actor.optimizer.lr == 1e-6
    assert "config key 'train_data.path' (RL2's original name) is now 'data.train.path'" in capsys.readouterr().out
    for bad in ({"actor.optimzer.lr": 1}, {"actor.dtype": "fp8"}, {"data.train.batch_size": "many"}):
        with pytest.raises(ConfigError) as from_api:
            build_config("ppo", bad)
        with pytest.raises(ConfigError) as from_cli:
            parse_config(PPOConfig, "ppo", override_args(bad))
        assert str(from_api.value) == str(from_cli.value)
    with pytest.raises(ConfigError, match="did you mean actor.optimizer.lr"):
        RL2.train("sft", {"actor.optimzer.lr": 1e-5})
    with pytest.raises(ConfigError, match="given twice"):
        build_config("sft", {"trainer": {"seed": 1}, "trainer.seed": 2})
    with pytest.raises(ConfigError, match="config key 'trainer.seed': cannot pass a set"):
        build_config("sft", {"trainer.seed": {1}})
    with pytest.raises(ConfigError, match="choose one of sft, dpo"):
        RL2.train("grpo", {})


def test_reward_function_errors_come_before_anything_runs():
    with pytest.raises(ConfigError, match="only the ppo trainer"):
        RL2.train("sft", {"data.train.path": "x.jsonl"}, reward=lambda response, extra_info: 1.0)
    with pytest.raises(ConfigError, match="both give the reward"):
        RL2.evaluate({"data.test.path": "x.jsonl", "rollout.reward_fn": "RL2.rewards:math_reward"},
                     reward=lambda response, extra_info: 1.0)
    with pytest.raises(ConfigError, match="must be a function"):
        RL2.train("ppo", {"data.train.path": "x.jsonl"}, reward="my_reward.py:reward")
    with pytest.raises(EnvError, match=r"reward=.*must accept \(response: str, extra_info: dict\)"):
        RL2.train("ppo", {"data.train.path": "x.jsonl"}, reward=lambda response: 1.0)


def test_importing_the_command_module_keeps_RL2_evaluate_a_function():
    import RL2.evaluate  # noqa: F401  (makes the attribute RL2.evaluate the module)

    with pytest.raises(ConfigError, match="data.test.path is not set"):
        RL2.evaluate({})


# ---- running --------------------------------------------------------------------------------------


def test_train_in_this_process_with_an_async_reward(tiny_model_path, tmp_path):
    """World size 1 in the test's own process; the reward is a closure, so only this process can run it."""
    rows = [{"prompt": f"question {k}", "extra_info": {"want": "\n"}} for k in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    async def reward(response: str, extra_info: dict) -> dict:
        await asyncio.sleep(0)
        value = float(response.startswith(extra_info["want"]))
        seen.append(value)
        return {"reward": value, "newline": value}

    rank_before = os.environ.get("RANK")
    run = RL2.train("ppo", {"data.train": {"path": tmp_path / "train.jsonl", "batch_size": 4},
                            "actor": {"model_name": tiny_model_path, "dtype": "float32", "max_length_per_device": 512},
                            "rollout": {"responses_per_prompt": 2, "train_sampling_params.max_new_tokens": 4},
                            "trainer": {"total_steps": 2, "save_dir": tmp_path / "run"}}, reward=reward)
    assert len(seen) == 2 * 4 * 2  # steps x prompts x responses, all scored here
    assert run.metrics["rollout/reward"] == pytest.approx(sum(seen[-8:]) / 8)  # the last step's mean
    assert run.metrics["rollout/reward/newline"] == pytest.approx(sum(seen[-8:]) / 8)
    assert [r["step"] for r in run.history] == [1, 2] and run.history == read_metrics(tmp_path / "run")
    assert run.model_path == tmp_path / "run" / "final" / "actor" and (run.model_path / "model.safetensors").exists()
    assert run.models == {"actor": run.model_path} and run.config.trainer.total_steps == 2
    assert os.environ.get("RANK") == rank_before  # the call's one-rank group is gone with its variables


def api_overrides(model: str, folder: Path, prompts: int, steps: int) -> tuple[dict, dict]:
    """Overrides of `RL2.train("ppo", ...)` (`steps` GRPO steps of 4 prompts x 2 responses on `prompts`
    prompts) and of `RL2.evaluate` (on the same prompts); data and results go under `folder`."""
    rows = [{"prompt": f"question {k}"} for k in range(prompts)]
    (folder / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = {"data.train": {"path": str(folder / "rl.jsonl"), "batch_size": 4},
             "actor": {"model_name": model, "dtype": "float32", "max_length_per_device": 512},
             "rollout": {"responses_per_prompt": 2, "train_sampling_params.max_new_tokens": 4},
             "trainer": {"total_steps": steps, "save_dir": str(folder / "run")}}
    evaluate = {"data.test.path": str(folder / "rl.jsonl"), "rollout.sampling_params.max_new_tokens": 4,
                "eval.save_dir": str(folder / "eval")}
    return train, evaluate


def test_train_then_evaluate_under_torchrun(tiny_model_path, tmp_path, monkeypatch):
    """Every rank calls RL2.train, then RL2.evaluate on the model it exported; both ranks get the
    same results, and the reward each rank's function returned is what the run logged. The group stays
    for the calls; the exit handler RL2 registers frees it (test_process_group_teardown.py)."""
    train, evaluate = api_overrides(tiny_model_path, tmp_path, prompts=8, steps=2)
    record_threads_at_exit(tmp_path / "exit_records", monkeypatch)
    run_ranks(2, [str(SCRIPTS / "train_api.py"), json.dumps(train), json.dumps(evaluate), str(tmp_path)])
    assert group_threads_at_exit(tmp_path / "exit_records", 2) == [[], []]
    got = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for key in ("metrics", "history", "model_path", "eval"):
        assert got[0][key] == got[1][key], key
    assert got[0]["history"] == read_metrics(tmp_path / "run")
    assert got[0]["model_path"] == str(tmp_path / "run" / "final" / "actor")
    report = json.loads((tmp_path / "eval" / "metrics.json").read_text())["model"]
    assert got[0]["eval"] == {"overall": report["overall"], "by_source": report["by_source"]}
    # Each rank scored its share: 2 steps of 4 prompts x 2 responses, then 8 test prompts x 1 sample.
    assert [len(g["returned"]) for g in got] == [8 + 4, 8 + 4]
    last_step = [value for g in got for value in g["returned"][4:8]]
    assert got[0]["metrics"]["rollout/reward"] == pytest.approx(sum(last_step) / 8)
    evaluation = [value for g in got for value in g["returned"][8:]]
    assert got[0]["eval"]["overall"]["accuracy"] == pytest.approx(sum(evaluation) / 8)


def readme_example() -> str:
    """The first Python block of docs/python-api.md."""
    section = (REPO / "docs" / "python-api.md").read_text()
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_readme_example(folder: Path, model: str | None) -> subprocess.CompletedProcess:
    code = readme_example()
    assert code.count(README_MODEL_LINE) == 1
    if model is not None:
        code = code.replace(README_MODEL_LINE, f"MODEL = {model!r}")
    (folder / "example.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    result = subprocess.run([sys.executable, "example.py"], cwd=folder, env=env, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def check_readme_outputs(folder: Path, stdout: str) -> None:
    last = read_metrics(folder / "ckpts" / "sums")[-1]
    assert last["step"] == 2
    assert (folder / "ckpts" / "sums" / "final" / "actor" / "model.safetensors").exists()
    report = json.loads((folder / "evals" / "sums" / "metrics.json").read_text())
    assert set(report["model"]["by_source"]) == {"small", "large"}
    samples = [json.loads(line) for line in (folder / "evals" / "sums" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 40 * 4  # two models, 40 prompts, 4 samples each
    printed = [line.split() for line in stdout.splitlines() if re.fullmatch(r"\S+ \S+", line.strip())]
    reward, model_path = printed[0]
    accuracy, pass_gain = printed[1]
    assert float(reward) == pytest.approx(last["rollout/reward"]) and model_path == "ckpts/sums/final/actor"
    assert float(accuracy) == pytest.approx(report["model"]["overall"]["accuracy"])
    assert float(pass_gain) == pytest.approx(report["difference"]["overall"]["pass@4"])


def test_readme_example_runs(tiny_model_path, tmp_path):
    """docs/python-api.md's code as written, but for the model (the tiny one)."""
    result = run_readme_example(tmp_path, tiny_model_path)
    check_readme_outputs(tmp_path, result.stdout)


@pytest.mark.slow
def test_readme_example_runs_on_the_embedded_model(tmp_path):
    result = run_readme_example(tmp_path, None)
    check_readme_outputs(tmp_path, result.stdout)
