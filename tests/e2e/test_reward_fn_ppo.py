"""GRPO end to end on a plain reward function (`rollout.reward_fn`, no environment script): the
reward rises, and the reward's parts reach metrics.jsonl as their own metrics."""

import json

import pytest

from tests.helpers import REWARDS
from tests.helpers.launch import read_metrics, run_ranks
from tests.helpers.tiny import sharpened_copy

REWARD_FN = REWARDS / "newline.py"
STEPS = 8


@pytest.mark.slow
def test_grpo_on_a_plain_reward_function(tiny_model_path, tmp_path):
    # The sharpened tiny model repeats "\n" after the chat template's "assistant\n" about a third of the time.
    model = sharpened_copy(tiny_model_path, tmp_path / "model")
    data = {}
    for split, n in (("train", 32), ("test", 4)):
        data[split] = tmp_path / f"{split}.jsonl"
        data[split].write_text("".join(json.dumps({"prompt": f"{split} question {k}"}) + "\n" for k in range(n)))
    save_dir = tmp_path / "run"
    run_ranks(1, ["-m", "RL2.trainer.ppo", f"data.train.path={data['train']}", f"data.test.path={data['test']}",
                  "data.train.batch_size=4", f"rollout.reward_fn={REWARD_FN}:reward",
                  "rollout.env_path=does/not/exist.py",  # unused: the reward function replaces it
                  "rollout.responses_per_prompt=4", "rollout.train_sampling_params.max_new_tokens=4",
                  "rollout.test_sampling_params.max_new_tokens=4", f"actor.model_name={model}", "actor.dtype=float32",
                  "actor.optimizer.lr=1e-3", "actor.max_length_per_device=512", f"trainer.save_dir={save_dir}",
                  f"trainer.total_steps={STEPS}", f"trainer.test_freq={STEPS}"])
    metrics = read_metrics(save_dir)
    train = [m for m in metrics if "rollout/reward" in m]
    assert len(train) == STEPS
    for m in train:
        # The parts are unweighted means; the reward is their weighted sum (composite's weights).
        assert m["rollout/reward"] == pytest.approx(m["rollout/reward/newline"] + 0.1 * m["rollout/reward/short"])
        assert m["rollout/score"] == pytest.approx(m["rollout/reward/newline"])  # score="newline"
        assert m["rollout/faults"] == 0
    newline = [m["rollout/reward/newline"] for m in train]
    first, last = sum(newline[:2]) / 2, sum(newline[-2:]) / 2
    assert first < 0.7 and last > first + 0.25, newline
    tests = [m for m in metrics if "test/reward/newline" in m]
    assert [m["step"] for m in tests] == [0, STEPS]
