"""Agents end to end: an agent script written against the `openai` client (tests/envs/agent_two_calls.py)
trained by the PPO trainer on two ranks, each rank serving it its own OpenAI endpoint, tested at step 0
and after the last step; and an environment that declares tools, whose prompts show them."""

import json

import pytest

from tests.helpers import ENVS
from tests.helpers.launch import read_metrics, run_ranks


@pytest.fixture(scope="module")
def agent_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent_data")
    for split, n in (("train", 8), ("test", 2)):
        rows = [{"prompt": f"{split} question {k}", "extra_info": {"data_source": "agent"}} for k in range(n)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_an_agent_script_trains_through_its_openai_endpoint(tiny_model_path, agent_data, tmp_path):
    run_ranks(2, ["-m", "RL2.trainer.ppo", f"data.train.path={agent_data / 'train.jsonl'}",
                  f"data.test.path={agent_data / 'test.jsonl'}", "data.train.batch_size=4",
                  f"rollout.agent_path={ENVS / 'agent_two_calls.py'}", "rollout.responses_per_prompt=4",
                  f"actor.model_name={tiny_model_path}", "actor.dtype=float32", "actor.max_length_per_device=512",
                  "trainer.total_steps=2", "trainer.test_freq=2", "rollout.save_samples=true",
                  f"trainer.save_dir={tmp_path}"])
    metrics = {m["step"]: m for m in read_metrics(tmp_path)}
    for step in (1, 2):
        m = metrics[step]
        assert (m["rollout/n_turns"], m["rollout/faults"], m["rollout/tool_calls"]) == (2.0, 0.0, 0.0)
        assert m["rollout/generate_s"] > 0 and "actor/loss" in m
        assert m["rollout/reward/odd"] == m["rollout/reward"]  # the agent's reward parts reach the metrics
    assert {"test/score", "test/tool_calls"} <= set(metrics[0]) and "test/score" in metrics[2]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4 * 4 and all(s["n_turns"] == 2 and s["fault"] is None for s in samples)
    # Each names its prompt's row of the data file, and the agent script.
    assert all(f"train question {s['row']}<|im_end|>" in s["prompt"] for s in samples)
    assert {s["script"] for s in samples} == {str(ENVS / "agent_two_calls.py")}
    # The second call sent back the first answer: it continued the first call's sequence, with the
    # template's turns for "Again." between the two answers (masked out of the loss).
    assert all("<|im_start|>user\nAgain.<|im_end|>" in s["response"] for s in samples)
    assert {s["prompt"].count("question") for s in samples} == {1}


def test_an_environment_with_tools_shows_them_to_the_policy(tiny_model_path, agent_data, tmp_path):
    run_ranks(1, ["-m", "RL2.trainer.ppo", f"data.train.path={agent_data / 'train.jsonl'}", "data.train.batch_size=2",
                  f"rollout.env_path={ENVS / 'tools.py'}", "rollout.responses_per_prompt=2", "rollout.max_turns=2",
                  "rollout.train_sampling_params.max_new_tokens=4", f"actor.model_name={tiny_model_path}",
                  "actor.dtype=float32", "actor.max_length_per_device=2048", "trainer.total_steps=1",
                  "rollout.save_samples=true", f"trainer.save_dir={tmp_path}"])
    [metrics] = read_metrics(tmp_path)
    assert {"rollout/tool_calls", "rollout/tool_errors", "rollout/tool_parse_errors",
            "rollout/tool_time_share"} <= set(metrics)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    # RL2's default tool block is the system message of every prompt (the tiny model's template shows no tools).
    assert all(s["prompt"].startswith("<|im_start|>system\n# Tools\n") and '"name": "count_chars"' in s["prompt"]
               for s in samples)
