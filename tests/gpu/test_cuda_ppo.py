"""The PPO trainer end to end on one GPU, with the embedded engine rolling out on the same GPU.

GRPO on the task of `tests/e2e/test_ppo.py` (learnable in seconds by a tiny random model): in float32
(packed attention through SDPA, prompts shared across their group's responses) and in bf16 (torch's own
varlen kernel where it has one). The reward rises, the weights synced into the engine after every
update are the actor's (engine-vs-trainer log-prob mismatch), and a PPO update with shared prefixes
equals the same update without them.
"""

import json

import pytest
import torch

pytest.importorskip("omegaconf", reason="the trainer's config needs omegaconf (`pip install -e .` installs it)")

from RL2.models.attention import varlen_backend  # noqa: E402
from tests.e2e.test_ppo import STEPS, assert_learned, ppo_args, repeat_model, rl_data  # noqa: E402, F401 (fixtures)
from tests.helpers.launch import read_metrics, run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Largest engine-vs-trainer mismatch (mean |logp_engine - logp_trainer| over response tokens) per dtype:
# float32 agrees to round-off; bf16 kernels of decode (engine) and packed training differ in round-off.
MISMATCH = {"float32": 1e-4, "bfloat16": 5e-2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_on_cuda_raises_reward_with_the_engine_on_the_same_gpu(repeat_model, rl_data, tmp_path, dtype):  # noqa: F811
    result = run_ranks(1, ppo_args(repeat_model, rl_data, tmp_path, "trainer.device=cuda", f"actor.dtype={dtype}",
                                   "trainer.test_freq=4"), timeout=600, device="cuda")
    assert_learned(tmp_path, repeat_model)
    metrics = read_metrics(tmp_path)
    mismatches = [m["actor/engine_mismatch"] for m in metrics if "actor/engine_mismatch" in m]
    assert len(mismatches) == STEPS and max(mismatches) < MISMATCH[dtype], mismatches
    log = result.stdout + result.stderr
    backend = varlen_backend(torch.device("cuda"), getattr(torch, dtype))
    if backend == "sdpa":  # float32, or no flash kernel: SDPA computes each group's prompt once
        assert f"shared-prefix attention: sdpa (cuda, {dtype})" in log, log[-2000:]
    else:  # a flash kernel keeps the packed row
        assert f"packed attention: {backend} (cuda, {dtype})" in log, log[-2000:]
    print({m["step"]: (round(m["rollout/reward"], 3), m["actor/engine_mismatch"], round(m["perf/step_s"], 2))
           for m in metrics if "perf/step_s" in m})


def test_engine_and_trainer_agree_at_a_sampling_temperature_on_cuda(repeat_model, rl_data, tmp_path):  # noqa: F811
    """At temperature 0.7 the embedded engine on the GPU reports log softmax(logits / 0.7) and the trainer
    (Triton's log-prob kernels where Triton imports) computes the same distribution's: engine_mismatch stays
    at float32 round-off over two passes with a reference. Each phase reports its GPU peak beside its RSS."""
    run_ranks(1, ppo_args(repeat_model, rl_data, tmp_path, "trainer.device=cuda", "actor.dtype=float32",
                          "rollout.train_sampling_params.temperature=0.7", "actor.kl.coef=0.01",
                          "actor.update_per_rollout=2", "trainer.total_steps=2"), timeout=600, device="cuda")
    metrics = [m for m in read_metrics(tmp_path) if "actor/engine_mismatch" in m]
    assert [m["step"] for m in metrics] == [1, 2], metrics
    assert max(m["actor/engine_mismatch"] for m in metrics) < MISMATCH["float32"], metrics
    assert all(m["perf/gpu_peak_gb"] >= m["perf/actor_update_gpu_peak_gb"] > 0 for m in metrics), metrics


def test_shared_prefixes_on_cuda_equal_each_sequence_alone(tiny_model_path, tmp_path):
    """A PPO update (two epochs, KL, entropy, critic) on CUDA in float32 with shared prefixes, against the
    same update with each sequence's prompt computed on its own."""
    config = [f"actor.model_name={tiny_model_path}", "actor.dtype=float32", "actor.optimizer.lr=1e-3",
              "actor.max_length_per_device=48", "actor.update_per_rollout=2", "actor.mini_batch_size=3",
              "actor.kl.coef=0.1", "actor.entropy.coef=0.01", "adv.estimator=gae", "critic.mini_batch_size=3",
              "critic.optimizer.lr=1e-3", "actor.optimizer.eps=1e-3", "critic.optimizer.eps=1e-3",
              "trainer.device=cuda"]
    reports = {}
    for name, extra in (("unshared", ["actor.share_prefixes=false", "critic.share_prefixes=false"]), ("shared", [])):
        out = tmp_path / f"{name}.pt"
        result = run_ranks(1, ["tests/e2e/scripts/ppo_update.py", str(out), *config, *extra], device="cuda")
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert (report["tokens_saved"] > 0) == (name == "shared"), (name, report["tokens_saved"])
        reports[name] = (report["metrics"], torch.load(out))
    (metrics1, weights1), (metrics2, weights2) = reports["unshared"], reports["shared"]
    assert metrics1 == pytest.approx(metrics2, rel=1e-4, abs=1e-6)
    for role in ("actor", "critic"):
        for key, value in weights1[role].items():
            torch.testing.assert_close(weights2[role][key], value, atol=1e-5, rtol=1e-4, msg=f"{role} {key}")
