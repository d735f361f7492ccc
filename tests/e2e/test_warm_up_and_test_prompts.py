"""PPO's critic warm-up (`actor.freeze_steps`) and a test split taken a batch per evaluation
(`rollout.test_prompts_per_rollout`), the original RL2's keys, in one run on a tiny model: the actor's
weights at the last frozen step are the initial ones while the critic's moved, the actor moves after,
and each evaluation tests the next prompts of a shuffled pass."""

import json

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers.launch import read_metrics, run_ranks

FROZEN, STEPS = 2, 3
# Rewards that differ from the first step on (a random tiny model's actions differ in length), for
# the critic to regress to and the actor to follow.
LENGTH_ENV = """
async def step(state, action, extra_info):
    return {"next_state": state + action, "reward": len(action) / 10, "done": True, "extra_info": extra_info}
"""
TEST_PROMPTS, PER_EVALUATION = 5, 2


def checkpoint_weights(folder, tmp_path, worker: str) -> dict[str, torch.Tensor]:
    """The model weights of `worker` ("actor", "critic") in a DCP checkpoint folder, by parameter name."""
    flat = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(folder, flat)
    return torch.load(flat, weights_only=True)[worker]["model"]


def test_frozen_actor_and_test_prompts_per_evaluation(tiny_model_path, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "length_env.py").write_text(LENGTH_ENV)
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": f"q{k}"}) + "\n" for k in range(8)))
    # One data_source per test prompt: the test metrics name the prompts each evaluation took.
    rows = [{"prompt": f"t{k}", "extra_info": {"data_source": f"t{k}"}} for k in range(TEST_PROMPTS)]
    (data / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    save_dir = tmp_path / "run"
    run_ranks(1, ["-m", "RL2.trainer.ppo", f"data.train.path={data / 'train.jsonl'}",
                  f"data.test.path={data / 'test.jsonl'}", "data.train.batch_size=2",
                  f"rollout.env_path={data / 'length_env.py'}", "rollout.responses_per_prompt=2",
                  "rollout.train_sampling_params.max_new_tokens=4", "rollout.test_sampling_params.max_new_tokens=2",
                  f"rollout.test_prompts_per_rollout={PER_EVALUATION}", f"actor.model_name={tiny_model_path}",
                  "actor.dtype=float32", "actor.optimizer.lr=1e-2", "actor.max_length_per_device=256",
                  f"actor.freeze_steps={FROZEN}", "adv.estimator=gae", "critic.optimizer.lr=1e-2",
                  f"trainer.save_dir={save_dir}", f"trainer.total_steps={STEPS}", "trainer.save_freq=1",
                  "trainer.test_freq=1"])

    initial = load_file(f"{tiny_model_path}/model.safetensors")
    frozen = checkpoint_weights(save_dir / f"step{FROZEN}", tmp_path, "actor")
    assert initial.keys() <= frozen.keys()
    assert all(torch.equal(frozen[k], initial[k]) for k in initial)  # not one update in the frozen steps
    critic = checkpoint_weights(save_dir / f"step{FROZEN}", tmp_path, "critic")
    assert any(not torch.equal(critic[k], initial[k]) for k in initial if k in critic)  # the critic learnt
    final = load_file(f"{save_dir}/final/actor/model.safetensors")
    assert any(not torch.equal(final[k], initial[k]) for k in initial)  # and the actor after them

    metrics = read_metrics(save_dir)
    trained = [m for m in metrics if "actor/frozen" in m]
    assert [m["actor/frozen"] for m in trained] == [1.0] * FROZEN + [0.0] * (STEPS - FROZEN)
    assert ["actor/loss" in m for m in trained] == [False] * FROZEN + [True] * (STEPS - FROZEN)

    # Evaluations at steps 0..3, each of PER_EVALUATION prompts: the first two are one shuffled pass
    # (4 different prompts of 5), the third starts another.
    tested = [sorted(k.split("/")[1] for k in m if k.startswith("test/t") and k.endswith("/score")) for m in metrics
              if any(k.startswith("test/") for k in m)]
    assert len(tested) == STEPS + 1 and all(len(prompts) == PER_EVALUATION for prompts in tested), tested
    assert len(set(tested[0] + tested[1])) == 2 * PER_EVALUATION, tested
