"""PPO trained on an LLM judge's scores end to end, on two ranks: rollout.judge.url (a chat-completions server the
test starts) gives each response the score the server answers, and a judge call that fails ends its trajectory as a
judge fault while the run goes on; rollout.judge.model_path loads a frozen model on every rank as the judge."""

import json

import pytest

from tests.helpers.judge_server import RUBRIC, JudgeServer
from tests.helpers.launch import read_metrics, run_ranks

pytestmark = pytest.mark.slow


def judge_args(model: str, tmp_path, questions: list[str], *extra: str) -> list[str]:
    rows = [{"prompt": f"question {k}", "extra_info": {"question": q}} for k, q in enumerate(questions)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rubric.txt").write_text(RUBRIC)
    return ["-m", "RL2.trainer.ppo", f"data.train.path={tmp_path / 'train.jsonl'}", "data.train.batch_size=4",
            "rollout.reward_fn=RL2.rewards:judge_reward", f"rollout.judge.rubric={tmp_path / 'rubric.txt'}",
            "rollout.responses_per_prompt=2", "rollout.train_sampling_params.max_new_tokens=4",
            f"actor.model_name={model}", "actor.dtype=float32", "actor.max_length_per_device=512",
            f"trainer.save_dir={tmp_path / 'run'}", "trainer.total_steps=1", *extra]


def test_ppo_on_an_http_judge(tiny_model_path, tmp_path):
    server = JudgeServer()
    try:
        run_ranks(2, judge_args(tiny_model_path, tmp_path, ["score 2", "score 6", "score 10", "fail"],
                                f"rollout.judge.url={server.url}", "rollout.judge.max_retries=0"))
    finally:
        server.stop()
    [metrics] = [m for m in read_metrics(tmp_path / "run") if "rollout/reward" in m]
    assert metrics["rollout/faults"] == metrics["rollout/faults/judge"] == 2.0  # the two responses of "fail"
    assert metrics["rollout/reward"] == pytest.approx((0.2 + 0.6 + 1.0) * 2 / 8)  # a fault counts 0 in the mean


def test_ppo_with_a_frozen_judge_on_every_rank(tiny_model_path, tmp_path):
    """The tiny random model as the judge writes no score: every trajectory is a judge fault, the run goes on."""
    result = run_ranks(2, judge_args(tiny_model_path, tmp_path, [f"q{k}" for k in range(4)],
                                     f"rollout.judge.model_path={tiny_model_path}", "rollout.judge.max_retries=0",
                                     "rollout.judge.max_new_tokens=4"))
    [metrics] = [m for m in read_metrics(tmp_path / "run") if "rollout/reward" in m]
    assert metrics["rollout/faults"] == metrics["rollout/faults/judge"] == 8.0
    assert ("8 of 8 trajectories ended by a fault (left out of the loss; judge 8), the first: step raised JudgeError"
            in result.stdout)
