"""The evaluator (`python -m RL2.evaluate`, `RL2.evaluate`): its metrics equal a computation of our own
from the samples it writes (pass@k by the product form of Chen et al.'s estimator), the scores are
the environment's verdict on the written responses, a model compared with itself differs by exactly
zero, a worse model shows negative differences of the right size, and 2 ranks sample what 1 does."""

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from RL2.evaluate import main
from RL2.rollout.metrics import evaluation_metrics, metrics_difference
from RL2.rollout.trajectory import Trajectory, Turn
from tests.helpers import ENVS, SCRIPTS, SGLANG_STUB
from tests.helpers.launch import run_ranks
from tests.helpers.sglang import SGLANG_PYTHON, needs_sglang
from tests.helpers.tiny import sharpened_copy

ENV = ENVS / "emit_token.py"
API_SCRIPT = SCRIPTS / "evaluate_api.py"
SAMPLES, NEW_TOKENS, KS = 4, 4, [1, 2, 4]
PREFIX = {"a": "\n", "b": "\n\n"}  # emit_token.py rewards a response starting with its row's prefix


def echo_copy(path: str, folder: Path) -> str:
    """The model at `path` with every attention and MLP output zeroed and its final norm scaled 30x:
    the last hidden state is the last token's embedding, so (tied embeddings) it repeats that token
    with probability ~1. After the chat template's "assistant\\n" it writes newlines only."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.mul_(30.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    return str(folder)


def pass_at_k_product(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s numerically stable form: 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@pytest.fixture(scope="module")
def sharp_model(tiny_model_path, tmp_path_factory) -> str:
    """Writes "\\n" first about a third of the time at temperature 1."""
    return sharpened_copy(tiny_model_path, tmp_path_factory.mktemp("sharp"))


@pytest.fixture(scope="module")
def test_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval_data") / "test.jsonl"
    rows = [{"prompt": f"question {i}", "extra_info": {"data_source": source, "prefix": PREFIX[source]}}
            for i, source in enumerate("ababab")]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def eval_args(model: str, data: Path, save_dir: Path, *extra: str) -> list[str]:
    return [f"model.model_name={model}", "model.dtype=float32", f"data.test.path={data}", f"rollout.env_path={ENV}",
            f"rollout.responses_per_prompt={SAMPLES}", "rollout.sampling_params.temperature=1.0",
            f"rollout.sampling_params.max_new_tokens={NEW_TOKENS}", f"eval.k=[{','.join(map(str, KS))}]",
            f"eval.save_dir={save_dir}", *extra]


def read_samples(save_dir: Path, role: str = "model") -> list[dict]:
    lines = (save_dir / "samples.jsonl").read_text().splitlines()
    return [s for s in map(json.loads, lines) if s["role"] == role]


def metrics_from_samples(samples: list[dict], threshold: float = 1.0) -> dict:
    """Our own computation of the reported metrics from the written samples."""
    by_prompt = defaultdict(list)
    for s in samples:
        by_prompt[(s["data_source"], s["prompt_index"])].append(s)

    def summary(groups: list[list[dict]]) -> dict:
        flat = [s for g in groups for s in g]
        out = {"n_prompts": len(groups), "n_samples": len(flat),
               "accuracy": sum(s["score"] >= threshold for s in flat) / len(flat),
               "score": sum(s["score"] for s in flat) / len(flat),
               "reward": sum(s["reward"] for s in flat) / len(flat),
               "response_length": sum(s["response_length"] for s in flat) / len(flat)}
        for k in KS:
            out[f"pass@{k}"] = sum(pass_at_k_product(len(g), sum(s["score"] >= threshold for s in g), k)
                                   for g in groups) / len(groups)
        return out

    sources = sorted({source for source, _ in by_prompt})
    return {"overall": summary(list(by_prompt.values())),
            "by_source": {src: summary([g for (s, _), g in by_prompt.items() if s == src]) for src in sources}}


def assert_close(reported: dict, expected: dict) -> None:
    for part in ("overall", "by_source"):
        flat_expected = {"": expected[part]} if part == "overall" else expected[part]
        flat_reported = {"": reported[part]} if part == "overall" else reported[part]
        assert flat_reported.keys() == flat_expected.keys()
        for source, metrics in flat_expected.items():
            for key, value in metrics.items():
                assert flat_reported[source][key] == pytest.approx(value, abs=1e-12), (part, source, key)


# ---- the metrics, on hand-made samples ----------------------------------------------------------


def trajectory(score: float, length: int, finish: str = "stop", parts: dict | None = None) -> Trajectory:
    t = Trajectory(extra_info={})
    t.start_sequence("p", [1, 2])
    t.add_turn(Turn([7] * length, [0.0] * length, "x" * length, finish, reward=2 * score, score=score,
                    reward_parts=parts or {}))
    return t


def test_metrics_of_hand_made_samples():
    groups = [[trajectory(1, 2), trajectory(0, 4, "length"), trajectory(0, 2), trajectory(1, 4, parts={"f": 1.0})],
              [trajectory(0, 1)] * 4,
              [trajectory(1, 3)] * 3 + [trajectory(0.5, 3)]]
    m = evaluation_metrics(groups, ["a", "a", "b"], [1, 2, 4], threshold=1.0)
    a, b, overall = m["by_source"]["a"], m["by_source"]["b"], m["overall"]
    # By hand: pass@2 with n=4 is 1 - C(4-c, 2)/C(4, 2): c=2 -> 5/6, c=0 -> 0, c=3 -> 1.
    assert a["pass@2"] == pytest.approx((5 / 6 + 0) / 2) and b["pass@2"] == pytest.approx(1.0)
    assert overall["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert a["pass@4"] == pytest.approx(0.5) and overall["pass@4"] == pytest.approx(2 / 3)
    assert a["pass@1"] == pytest.approx(0.25) and b["pass@1"] == pytest.approx(0.75)
    assert a["accuracy"] == pytest.approx(2 / 8) and b["accuracy"] == pytest.approx(3 / 4)
    assert overall["accuracy"] == pytest.approx(5 / 12) and overall["score"] == pytest.approx(5.5 / 12)
    assert overall["reward"] == pytest.approx(11 / 12)
    assert a["response_length"] == pytest.approx((2 + 4 + 2 + 4 + 4 * 1) / 8) and a["truncated"] == pytest.approx(1 / 8)
    assert a["reward/f"] == pytest.approx(1 / 8) and "reward/f" not in b
    assert (a["n_prompts"], a["n_samples"], overall["n_prompts"], overall["n_samples"]) == (2, 8, 3, 12)
    # A lower threshold lets the 0.5 pass.
    assert evaluation_metrics(groups, ["a", "a", "b"], [4], 0.5)["by_source"]["b"]["accuracy"] == 1.0
    difference = metrics_difference(m, evaluation_metrics(groups[:2], ["a", "a"], [1, 2, 4], 1.0))
    assert difference["overall"]["accuracy"] == pytest.approx(5 / 12 - 2 / 8)
    assert list(difference["by_source"]) == ["a"] and difference["by_source"]["a"]["pass@2"] == 0.0
    assert "n_prompts" not in difference["overall"]


# ---- end to end on the tiny model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def same_model_run(sharp_model, test_data, tmp_path_factory):
    """One rank, the sharpened model compared with itself; returns (save_dir, stdout)."""
    save_dir = tmp_path_factory.mktemp("same_model")
    result = run_ranks(1, ["-m", "RL2.evaluate", *eval_args(sharp_model, test_data, save_dir,
                                                             f"compare.model_name={sharp_model}")])
    return save_dir, result.stdout


def test_metrics_equal_a_computation_from_the_samples(same_model_run, test_data):
    save_dir, stdout = same_model_run
    report = json.loads((save_dir / "metrics.json").read_text())
    samples = read_samples(save_dir)
    assert len(samples) == 6 * SAMPLES and all(s["response_length"] <= NEW_TOKENS for s in samples)
    for s in samples:  # the score is the environment's verdict on the response written
        assert s["score"] == float(s["response"].startswith(PREFIX[s["data_source"]])) == float(s["passed"])
        # where its prompt came from: the row of the data file ("question <row>"), the file and the script
        assert f"question {s['row']}" in s["prompt"] and (s["data"], s["script"]) == (str(test_data), str(ENV))
    assert_close(report["model"], metrics_from_samples(samples))
    # Sampled at temperature 1, some responses pass and some do not: pass@k means something here.
    assert 0 < report["model"]["overall"]["accuracy"] < 1, report["model"]["overall"]
    assert report["model"]["overall"]["pass@4"] > report["model"]["overall"]["pass@1"]
    for line in ("data_source", "pass@4", "overall", "model - compare"):
        assert line in stdout


def test_same_model_twice_differs_by_zero(same_model_run):
    save_dir, _ = same_model_run
    report = json.loads((save_dir / "metrics.json").read_text())
    assert report["compare"]["overall"] == report["model"]["overall"]
    differences = [report["difference"]["overall"], *report["difference"]["by_source"].values()]
    assert all(value == 0 for d in differences for value in d.values()) and "accuracy" in differences[0]
    # Same seeds, same model: every sample is the same sample.
    strip = lambda s: {k: v for k, v in s.items() if k != "role"}  # noqa: E731
    assert list(map(strip, read_samples(save_dir, "compare"))) == list(map(strip, read_samples(save_dir)))


def test_two_ranks_through_the_python_api_equal_one_rank(same_model_run, sharp_model, test_data, tmp_path):
    """torchrun, every rank calling RL2.evaluate with an async Python reward (the env script's rule)."""
    one_rank, _ = same_model_run
    overrides = {"model": {"model_name": sharp_model, "dtype": "float32"}, "compare.model_name": sharp_model,
                 "data.test.path": test_data, "rollout": {"responses_per_prompt": SAMPLES, "sampling_params": {
                     "temperature": 1.0, "max_new_tokens": NEW_TOKENS}},
                 "eval": {"k": KS, "save_dir": str(tmp_path / "two")}}
    run_ranks(2, [str(API_SCRIPT), json.dumps(overrides, default=str), str(tmp_path)])
    assert (tmp_path / "two" / "metrics.json").read_text() == (one_rank / "metrics.json").read_text()
    two, one = ([json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
                for run in (tmp_path / "two", one_rank))
    # Each sample names its reward's source: the env script there, the Python function here.
    assert {s.pop("script") for s in two} == {"reward=reward"} and [s.pop("script") for s in one]
    assert two == one
    reported = json.loads((one_rank / "metrics.json").read_text())
    for rank in (0, 1):  # every rank returns the result
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["metrics"] == {k: reported["model"][k] for k in ("overall", "by_source")}
        assert got["difference"] == reported["difference"]


def test_a_worse_model_shows_negative_differences(tiny_model_path, test_data, tmp_path):
    echo = echo_copy(tiny_model_path, tmp_path / "echo")
    save_dir = tmp_path / "eval"
    run_ranks(1, ["-m", "RL2.evaluate", *eval_args(tiny_model_path, test_data, save_dir, f"compare.model_name={echo}")])
    report = json.loads((save_dir / "metrics.json").read_text())
    model, compare = (metrics_from_samples(read_samples(save_dir)),
                      metrics_from_samples(read_samples(save_dir, "compare")))
    assert_close(report["model"], model)
    assert_close(report["compare"], compare)
    assert compare["overall"]["accuracy"] == 1.0  # newlines only: every prefix matches
    assert model["overall"]["accuracy"] < 0.5  # the untouched random model rarely starts with one
    for source in ("a", "b"):
        for key in ("accuracy", "score", "pass@1", "pass@4"):
            expected = model["by_source"][source][key] - compare["by_source"][source][key]
            assert report["difference"]["by_source"][source][key] == pytest.approx(expected) and expected < 0


@needs_sglang
@pytest.mark.slow
def test_sglang_samples_what_the_embedded_engine_samples(sharp_model, test_data, tmp_path):
    """Greedy in float32: a launched SGLang server writes the embedded engine's responses."""
    greedy = ["rollout.sampling_params.temperature=0", "rollout.sampling_params.max_new_tokens=8"]
    run_ranks(1, ["-m", "RL2.evaluate", *eval_args(sharp_model, test_data, tmp_path / "embedded", *greedy)])
    run_ranks(1, ["-m", "RL2.evaluate", *eval_args(sharp_model, test_data, tmp_path / "sglang", *greedy),
                  "rollout.engine=sglang", f"rollout.server_python={SGLANG_PYTHON}",
                  f"rollout.server_env.PYTHONPATH={SGLANG_STUB}", "rollout.server_args.max_total_tokens=4096",
                  f"rollout.server_log_dir={tmp_path / 'logs'}"], timeout=900)
    assert "--device cpu" in next((tmp_path / "logs").glob("sglang-*.log")).read_text()
    embedded, sglang = read_samples(tmp_path / "embedded"), read_samples(tmp_path / "sglang")
    assert [s["response"] for s in sglang] == [s["response"] for s in embedded]
    assert any(s["response"] for s in embedded)
    assert (tmp_path / "sglang" / "metrics.json").read_text() == (tmp_path / "embedded" / "metrics.json").read_text()


# ---- config ---------------------------------------------------------------------------------------


def test_help_lists_the_keys(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.split("RL2's original key names")[0]  # the keys, not the alias table
    for key in ("model.model_name", "compare.model_name", "data.test.path", "rollout.reward_fn", "rollout.engine",
                "rollout.sampling_params.temperature", "eval.k", "eval.threshold"):
        assert key in out
    assert "rollout.train_sampling_params" not in out and "rollout.dynamic_filtering" not in out


@pytest.mark.parametrize("args, words", [
    (["data.test.path=x.jsonl", "rollout.test_sampling_params.temperature=1"],
     "unknown config key 'rollout.test_sampling_params'.*did you mean rollout.sampling_params"),
    (["rollout.responses_per_prompt=2"], "data.test.path is not set"),
    (["data.test.path=x.jsonl", "rollout.responses_per_prompt=2", "eval.k=[1,4]"], r"eval.k has \[4\]"),
    (["data.test.path=does/not/exist.jsonl", "rollout.reward_fn=RL2.rewards:math_reward"], "does/not/exist.jsonl"),
    (["data.test.path=x.jsonl", "rollout.sampling_params.top_p=1.5"],
     r"rollout\.sampling_params\.top_p=1\.5; .*\(0, 1\]"),
])
def test_bad_config_fails_at_start_naming_the_key(args, words):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code.startswith("RL2 evaluate: ")
    assert re.search(words, exit_info.value.code), exit_info.value.code


def test_a_save_dir_that_cannot_be_made_fails_before_sampling(test_data, tmp_path, monkeypatch):
    """The samples and metrics are written at the end: an unusable eval.save_dir must stop the run before
    any model is sampled, not lose the samples after it."""
    from RL2.evaluation import evaluator

    monkeypatch.setattr(evaluator, "load_tokenizer", lambda cfg: pytest.fail("a model was loaded"))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit, match=rf"^RL2 evaluate: eval\.save_dir={blocker}/out: cannot create it \(Not a "
                                         r"directory: .*\); give a folder this user can write$"):
        main([f"data.test.path={test_data}", "rollout.reward_fn=RL2.rewards:math_reward",
              f"eval.save_dir={blocker}/out"])


def test_a_compared_model_that_is_not_there_is_named_as_the_compared_one(tiny_model_path, test_data, tmp_path):
    """The compared model's section is a copy of model's: its error must still name compare.model_name."""
    missing = tmp_path / "baseline"
    with pytest.raises(AssertionError, match=rf"RL2 evaluate: compare\.model_name={missing}: cannot load it: no such "
                                             r"folder"):
        run_ranks(1, ["-m", "RL2.evaluate", *eval_args(tiny_model_path, test_data, tmp_path / "out",
                                                       f"compare.model_name={missing}")])
