"""Multi-turn credit assignment end to end: one PPO step on an environment whose every turn starts a
new sequence (tests/envs/restart.py); the trainer's advantages equal a computation per trajectory
from its turn rewards alone."""

import json

import pytest

from tests.helpers import ENVS
from tests.helpers.launch import run_ranks


@pytest.fixture(scope="module")
def restart_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("restart") / "train.jsonl"
    rows = [{"prompt": f"Start {k}.", "extra_info": {"turns": 3}} for k in range(4)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_multiturn_step(nproc, model, data, save_dir, *extra) -> list[list[dict]]:
    env = ENVS / "restart.py"
    args = [f"data.train.path={data}", "data.train.batch_size=2", f"rollout.env_path={env}", "rollout.max_turns=3",
            "rollout.responses_per_prompt=4", "rollout.train_sampling_params.max_new_tokens=3",
            f"actor.model_name={model}", "actor.dtype=float32", "critic.dtype=float32",
            "actor.max_length_per_device=256", f"trainer.save_dir={save_dir}", *extra]
    result = run_ranks(nproc, ["tests/e2e/scripts/multiturn_advantages.py", *args])
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_end_to_end_grpo_counts_each_multi_sequence_trajectory_once(tiny_model_path, restart_data, tmp_path):
    groups = run_multiturn_step(2, tiny_model_path, restart_data, tmp_path, "adv.estimator=grpo")
    assert len(groups) == 2 and all(len(group) == 4 for group in groups)
    rewards = [[sum(t["turn_rewards"]) for t in group] for group in groups]
    assert len({r for group in rewards for r in group}) > 1, "the environment should give different rewards"
    for group, group_rewards in zip(groups, rewards):
        mean = sum(group_rewards) / len(group_rewards)  # over the group's 4 trajectories, not its 12 sequences
        for t, reward in zip(group, group_rewards):
            assert len(t["advantages"]) == 3  # one sequence per turn
            assert [a for seq in t["advantages"] for a in seq] == pytest.approx(
                [reward - mean] * sum(len(seq) for seq in t["advantages"]), abs=1e-5)


def test_end_to_end_gae_returns_flow_into_earlier_sequences(tiny_model_path, restart_data, tmp_path):
    # The critic's head starts at zero, so every value is 0 and, with gamma = lamda = 1, each token's
    # advantage is the reward still to come in its trajectory: its turn's and every later turn's.
    groups = run_multiturn_step(1, tiny_model_path, restart_data, tmp_path, "adv.estimator=gae")
    for t in (t for group in groups for t in group):
        to_come = [sum(t["turn_rewards"][k:]) for k in range(len(t["turn_rewards"]))]
        assert t["advantages"] == [pytest.approx([r] * len(seq), abs=1e-5) for r, seq in zip(to_come, t["advantages"])]
        assert t["returns"] == t["advantages"]
