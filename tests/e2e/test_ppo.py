"""RL trainer end to end on a tiny random Llama: GRPO, PPO (critic), GSPO and CISPO raise the reward of
a task learnable in seconds, the update is the same on 1 and 2 ranks, GSPO's trajectory-level ratio
matches the model's own forward, the entropy floor resets the reference, and a resumed run ends where
an uninterrupted one ends."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForTokenClassification

from tests.helpers import ENVS
from tests.helpers.launch import read_metrics, run_ranks
from tests.helpers.tiny import make_tiny_model, sharpened_copy

ENV = ENVS / "emit_token.py"
STEPS = 8


@pytest.fixture(scope="module")
def repeat_model(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model sharpened, so it repeats the prompt's last token ("\\n" after the chat template's
    "assistant\\n") about a third of the time: emit_token.py's reward starts near 0.3."""
    return sharpened_copy(tiny_model_path, tmp_path_factory.mktemp("repeat_model"))


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("rl_data")
    paths = {}
    for split, n in (("train", 32), ("test", 4)):
        rows = [{"prompt": f"{split} question {k}", "extra_info": {"data_source": "emit"}} for k in range(n)]
        paths[split] = folder / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def ppo_args(model, data, save_dir, *extra):
    return ["-m", "RL2.trainer.ppo", f"data.train.path={data['train']}", f"data.test.path={data['test']}",
            "data.train.batch_size=4", f"rollout.env_path={ENV}", "rollout.responses_per_prompt=4",
            "rollout.train_sampling_params.max_new_tokens=4", "rollout.test_sampling_params.max_new_tokens=4",
            f"actor.model_name={model}", "actor.dtype=float32", "actor.optimizer.lr=1e-3",
            "actor.max_length_per_device=512", f"trainer.save_dir={save_dir}", f"trainer.total_steps={STEPS}",
            *extra]


def rewards(save_dir) -> list[float]:
    return [m["rollout/reward"] for m in read_metrics(save_dir) if "rollout/reward" in m]


def assert_learned(save_dir, initial_model, role="actor"):
    reward = rewards(save_dir)
    assert len(reward) == STEPS
    first, last = sum(reward[:2]) / 2, sum(reward[-2:]) / 2
    assert first < 0.7 and last > first + 0.25, reward
    initial = load_file(f"{initial_model}/model.safetensors")
    final = load_file(f"{save_dir}/final/{role}/model.safetensors")
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


@pytest.fixture(scope="module")
def grpo_run(repeat_model, rl_data, tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("grpo")
    run_ranks(2, ppo_args(repeat_model, rl_data, save_dir, "trainer.save_freq=4", "trainer.test_freq=4",
                          "trainer.plot_learning_curve=true"))
    return save_dir


def test_grpo_raises_reward(grpo_run, repeat_model):
    assert_learned(grpo_run, repeat_model)
    metrics = read_metrics(grpo_run)
    step = next(m for m in metrics if m["step"] == 1)
    for key in ("actor/loss", "actor/clip_frac_low", "actor/clip_frac_high", "actor/approx_kl", "actor/entropy",
                "actor/grad_norm", "adv/mean", "adv/std", "perf/rollout_s", "perf/actor_update_s", "perf/sync_s",
                "perf/rollout_tokens_per_s", "perf/actor_update_tokens_per_s", "perf/step_s", "rollout/clip_ratio",
                "rollout/response_length", "actor/engine_kl"):
        assert key in step, key
    phase_peaks = [value for key, value in step.items() if key.endswith("_peak_gb")]
    assert len(phase_peaks) == 3 and step["perf/peak_gb"] == max(phase_peaks) > 0.1  # rollout, update, sync
    assert all(m["perf/weight_push_s"] > 0 for m in metrics if "perf/step_s" in m)  # a push every step
    # The trainer recomputes the engine's log-probabilities of the sampled tokens (both float32): at
    # every step, so the weights synced into the engines after each update are the actor's.
    assert all(m["actor/engine_mismatch"] < 1e-4 for m in metrics if "actor/engine_mismatch" in m)
    # Synchronous: every trained token was sampled by the weights trained (lag 0, which the engines named).
    trained = [m for m in metrics if "actor/loss" in m]
    assert all(m["staleness/lag_0"] == 1.0 and m["staleness/max_span"] == 0 for m in trained)
    assert all(m["actor/engine_kl_lag0"] < 1e-4 and "actor/engine_kl_lagged" not in m for m in trained)
    tests = [m for m in metrics if "test/emit/score" in m]
    assert [m["step"] for m in tests] == [0, 4, 8]  # before training, at test_freq and at the end
    assert tests[-1]["test/emit/score"] >= tests[0]["test/emit/score"]
    assert (grpo_run / "learning_curve.png").stat().st_size > 0


def test_engine_logprobs_are_the_trainers_at_the_sampling_temperature(repeat_model, rl_data, tmp_path):
    """At temperature 0.7 the engine samples from softmax(logits / 0.7) and reports its log-probabilities; the
    trainer's old log-probabilities (two passes over the rollout), its reference's and its ratio are of the
    same distribution: engine_mismatch stays at float32 round-off (it is ~0.3 nats against temperature 1's)."""
    run_ranks(1, ppo_args(repeat_model, rl_data, tmp_path, "rollout.train_sampling_params.temperature=0.7",
                          "actor.update_per_rollout=2", "actor.kl.coef=0.01", "trainer.total_steps=2"))
    metrics = [m for m in read_metrics(tmp_path) if "actor/engine_mismatch" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["actor/engine_mismatch"] < 1e-4 for m in metrics), metrics
    assert metrics[1]["actor/kl"] > 0  # to the reference, at the same temperature


def test_resume_equals_uninterrupted(grpo_run, repeat_model, rl_data, tmp_path):
    # A run killed after step 5: only the step-4 checkpoint survives.
    resumed = tmp_path / "resumed"
    shutil.copytree(grpo_run / "step4", resumed / "step4")
    (resumed / "metrics.jsonl").write_text(
        "".join(json.dumps(m) + "\n" for m in read_metrics(grpo_run) if m["step"] <= 5))
    run_ranks(2, ppo_args(repeat_model, rl_data, resumed, "trainer.save_freq=4", "trainer.test_freq=4",
                          "trainer.load_ckpt_from=latest"))
    assert rewards(resumed) == rewards(grpo_run)  # the same rollouts: sampling is seeded per rank and step
    straight_loss = [m["actor/loss"] for m in read_metrics(grpo_run) if "actor/loss" in m]
    assert [m["actor/loss"] for m in read_metrics(resumed) if "actor/loss" in m] == pytest.approx(
        straight_loss, abs=1e-6)
    expected = load_file(f"{grpo_run}/final/actor/model.safetensors")
    for key, value in load_file(f"{resumed}/final/actor/model.safetensors").items():
        torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=1e-5)


def test_ppo_with_critic_raises_reward(repeat_model, rl_data, tmp_path):
    # Eight responses a prompt: GAE's advantages lean on a critic that starts untrained, and with 16 samples a
    # step the reward's rise under lr 1e-3 depended on the CPU's rounding (it peaked, then fell on an AVX2 CPU).
    run_ranks(1, ppo_args(repeat_model, rl_data, tmp_path, "adv.estimator=gae", "critic.optimizer.lr=1e-3",
                          "rollout.responses_per_prompt=8"))
    assert_learned(tmp_path, repeat_model)
    assert (tmp_path / "final" / "critic" / "model.safetensors").exists()
    assert all("critic/loss" in m for m in read_metrics(tmp_path))


def test_update_two_ranks_equal_one_rank(tiny_model_path, tmp_path):
    """Two PPO epochs over two mini-batches, KL loss, entropy bonus, dual clip, TIS and a critic (GAE) at once.
    One rank without shared prefixes (each sequence's prompt computed on its own) is the reference of
    one and two ranks with them."""
    config = [f"actor.model_name={tiny_model_path}", "actor.dtype=float32", "actor.optimizer.lr=1e-3",
              "actor.max_length_per_device=48", "actor.update_per_rollout=2", "actor.mini_batch_size=3",
              "actor.kl.coef=0.1", "actor.entropy.coef=0.01", "actor.dual_clip=3", "actor.tis_coef=2",
              "actor.clip_high=0.28", "actor.avg_level=sequence", "adv.estimator=gae", "critic.value_clip=0.2",
              "critic.mini_batch_size=3", "critic.optimizer.lr=1e-3", "actor.optimizer.eps=1e-3",
              "critic.optimizer.eps=1e-3"]
    unshared = ["actor.share_prefixes=false", "critic.share_prefixes=false"]
    # Adam with a tiny eps moves a weight by about lr whatever the size of its gradient, so round-off in
    # gradients near zero would decide by how much; eps=1e-3 keeps the update proportional to small
    # gradients. A wrong loss or gradient split moves whole rows.
    reports = {}
    for name, nproc, extra in (("unshared", 1, unshared), ("shared", 1, []), ("shared-2-ranks", 2, [])):
        out = tmp_path / f"{name}.pt"
        result = run_ranks(nproc, ["tests/e2e/scripts/ppo_update.py", str(out), *config, *extra])
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert (report["tokens_saved"] > 0) == (name != "unshared"), (name, report["tokens_saved"])
        reports[name] = (report["metrics"], torch.load(out))
    metrics1, weights1 = reports.pop("unshared")
    for name, (metrics2, weights2) in reports.items():
        assert metrics1 == pytest.approx(metrics2, rel=1e-4, abs=1e-6), name
        for role in ("actor", "critic"):
            for key, value in weights1[role].items():
                torch.testing.assert_close(weights2[role][key], value, atol=1e-5, rtol=1e-4,
                                           msg=lambda m, role=role, key=key, name=name: f"{name} {role} {key}: {m}")
    assert metrics1["actor/kl"] > 0 and metrics1["actor/grad_norm"] > 0 and metrics1["critic/grad_norm"] > 0
    initial = load_file(f"{tiny_model_path}/model.safetensors")
    assert any(not torch.equal(initial[k], weights1["actor"][k]) for k in initial)
    assert weights1["critic"]["score.weight"].abs().sum() > 0  # the zero-initialised head learnt


def test_an_environment_that_fails_some_steps_says_why_in_the_log(repeat_model, tmp_path):
    """A failing `step` ends its trajectory with reward 0 and the run goes on: the log must carry the
    environment's own error, not only the count in rollout/faults; the faulted trajectories are left out of
    training, and samples.jsonl names the row and the files each trajectory came from."""
    rows = [{"prompt": f"question {k}", "extra_info": {"fault": "raise" if k < 2 else "none"}} for k in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data, env = {"train": tmp_path / "train.jsonl", "test": ""}, ENVS / "faulty.py"
    result = run_ranks(1, ppo_args(repeat_model, data, tmp_path / "run", f"rollout.env_path={env}",
                                   "trainer.total_steps=1", "rollout.save_samples=true"))
    metrics = read_metrics(tmp_path / "run")[0]
    assert metrics["rollout/faults"] == metrics["rollout/faults/raised"] == 8.0  # 2 x 4 responses; the run went on
    assert metrics["actor/faulted_excluded"] == 8.0 and "actor/loss" in metrics  # the other 8 were trained
    assert ("step 1: 8 of 16 trajectories ended by a fault (left out of the loss; raised 8), the first: step raised "
            f"KeyError: 'broken env' ({env})") in result.stdout
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["row"] for s in samples) == [k for k in range(4) for _ in range(4)]
    assert all(f"question {s['row']}" in s["prompt"] for s in samples)
    assert all((s["fault"] is not None) == (s["row"] < 2) for s in samples)
    assert {(s["data"], s["script"]) for s in samples} == {(str(data["train"]), str(env))}


def test_a_rollout_error_on_one_rank_stops_every_rank_with_its_message(repeat_model, tmp_path):
    """Rank 1's second prompt is too long for rollout.max_total_tokens: rank 0, whose rollout succeeds,
    must not wait for rank 1's results; both stop, naming rank 1's error."""
    rows = [{"prompt": "word " * (300 if k == 3 else 2)} for k in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"train": tmp_path / "train.jsonl", "test": ""}
    with pytest.raises(AssertionError, match=r"\[rank0\]: RuntimeError: the rollout failed:\n"
                                               r"\[rank0\]: rank 1: ValueError: a prompt of \d+ tokens leaves"):
        run_ranks(2, ppo_args(repeat_model, data, tmp_path / "run", "data.shuffle=false",
                              "rollout.max_total_tokens=64"),
                  timeout=120)


def test_reward_model_and_teacher_run_in_a_step(tiny_model_path, rl_data, tmp_path):
    reward_model = tmp_path / "rm"
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_path, num_labels=1)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # a head that gives different scores
    model.save_pretrained(reward_model)
    teacher = make_tiny_model(tmp_path / "teacher", seed=3)
    result = run_ranks(1, ["tests/e2e/scripts/ppo_reward_model_teacher.py",
                           *ppo_args(tiny_model_path, rl_data, tmp_path / "run", f"rollout.reward_model={reward_model}",
                                     f"actor.teacher.model_name={teacher}", "critic.dtype=float32")[2:]])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["packed"] == pytest.approx(report["direct"], abs=1e-4)
    assert len(set(round(x, 4) for x in report["direct"])) == 3
    assert {"rollout/reward_model_score", "actor/teacher_kl"} <= set(report["metrics"])


def test_reference_reset_copies_the_actor(repeat_model, rl_data, tmp_path):
    """With a reset after every step, the reference of step 2 is the actor that sampled it: KL ~ 0.
    Without the reset it is the initial model, which the actor has left by then."""
    kl = ["actor.kl.coef=0.01", "actor.kl.type=reward", "actor.kl.estimator=k1", "trainer.total_steps=2"]
    run_ranks(1, ppo_args(repeat_model, rl_data, tmp_path / "reset", *kl, "actor.kl.reset_every=1"))
    run_ranks(1, ppo_args(repeat_model, rl_data, tmp_path / "plain", *kl))
    reset, plain = read_metrics(tmp_path / "reset"), read_metrics(tmp_path / "plain")
    assert [m["actor/ref_reset"] for m in reset] == [1.0, 1.0]
    assert abs(reset[1]["actor/ref_kl"]) < 1e-4 and abs(plain[1]["actor/ref_kl"]) > 1e-3
    assert not (tmp_path / "reset" / "final" / "ref").exists()


def test_eval_only_evaluates_and_stops(repeat_model, rl_data, tmp_path):
    run_ranks(1, ppo_args(repeat_model, rl_data, tmp_path, "trainer.eval_only=true"))
    [metrics] = read_metrics(tmp_path)
    assert metrics["step"] == 0 and "test/emit/score" in metrics and "rollout/reward" not in metrics
    assert not (tmp_path / "final").exists()


def test_partial_rollout_and_dynamic_filtering_resume_exactly(repeat_model, rl_data, tmp_path):
    """Partial rollout carries unfinished groups across steps (two groups beyond the batch kept in flight,
    none trained more than one update stale, IcePop correcting them) and dynamic filtering draws extra
    prompts; both are rollout state that a checkpoint keeps: a resumed run ends where an uninterrupted one does."""
    args = ["rollout.partial_rollout=true", "rollout.over_sampling=2", "rollout.max_staleness=1",
            "actor.correction.type=icepop", "rollout.dynamic_filtering=true", "rollout.max_sampling_rounds=2",
            "rollout.max_running_requests=4", "rollout.train_sampling_params.max_new_tokens=6",
            "trainer.total_steps=4", "trainer.save_freq=2", "rollout.save_samples=true"]
    straight = tmp_path / "straight"
    run_ranks(2, ppo_args(repeat_model, rl_data, straight, *args, "trainer.plot_learning_curve=true"))
    metrics = read_metrics(straight)
    assert any(m["rollout/carried_groups"] > 0 for m in metrics), "some groups should be cut by the pause"
    for m in metrics:
        assert m["rollout/kept_groups"] <= 4 and (m["rollout/kept_groups"] == 4 or m["rollout/sampling_rounds"] == 2)
    # Carried tokens are trained one update late, never two; the engine's log-probabilities of those drifted.
    assert any(m["staleness/lag_1"] > 0 for m in metrics) and not any("staleness/lag_2" in m for m in metrics)
    lagged = [m for m in metrics if "actor/engine_kl_lagged" in m]
    assert lagged and all(m["actor/engine_kl_lag0"] < 1e-4 < m["actor/engine_kl_lagged"] for m in lagged)
    assert all({"actor/correction_frac", "actor/correction_weight_min", "actor/correction_weight_max"} <= set(m)
               for m in metrics if "actor/loss" in m)
    state = json.loads((straight / "step2" / "trainer_state.json").read_text())
    assert state["cursor"] == sum(m["rollout/sampling_rounds"] for m in metrics[:2])
    assert state["drawn"] > 4 * state["cursor"]  # the first step drew 2 prompts beyond its batch
    # Reward, response length, and for a partial rollout staleness and the engine KL: 5 x 3.8 inches a panel.
    assert Image.open(straight / "learning_curve.png").size == (500 * 4, 380)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "step2", resumed / "step2")
    shutil.copy(straight / "samples.jsonl", resumed)  # as a run killed after its last step left it
    run_ranks(2, ppo_args(repeat_model, rl_data, resumed, *args, "trainer.load_ckpt_from=latest"))
    assert rewards(resumed) == rewards(straight)[2:]
    stale = [[m[k] for k in sorted(m) if k.startswith("staleness/")] for m in read_metrics(straight)[2:]]
    assert [[m[k] for k in sorted(m) if k.startswith("staleness/")] for m in read_metrics(resumed)] == stale
    # The steps redone replace their samples rather than add to them.
    assert (resumed / "samples.jsonl").read_text() == (straight / "samples.jsonl").read_text()
    expected = load_file(f"{straight}/final/actor/model.safetensors")
    for key, value in load_file(f"{resumed}/final/actor/model.safetensors").items():
        torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=1e-5)


def test_max_staleness_0_drops_every_group_a_partial_rollout_carried(repeat_model, rl_data, tmp_path):
    """A bound of 0 updates: the next step first drops every carried group that holds a sampled token (those
    of the checkpoint's trainer state after step 1), refills the slots with new prompts, and trains on
    tokens of the current weights only, which needs no correction."""
    run_ranks(1, ppo_args(repeat_model, rl_data, tmp_path, "rollout.partial_rollout=true", "rollout.over_sampling=4",
                          "rollout.max_staleness=0", "rollout.max_running_requests=4",
                          "rollout.train_sampling_params.max_new_tokens=6", "trainer.total_steps=2",
                          "trainer.save_freq=1"))
    metrics = read_metrics(tmp_path)
    carried = json.loads((tmp_path / "step1" / "trainer_state.json").read_text())["carried"]
    sampled = sum(any(turn["action_versions"] for t in group for seq in t["sequences"] for turn in seq["turns"])
                  for group in carried)
    assert sampled > 0, "the pause should cut some groups after they sampled"
    assert [m["staleness/dropped_groups"] for m in metrics] == [0, sampled]
    assert all(m["staleness/lag_0"] == 1.0 and "actor/engine_kl_lagged" not in m for m in metrics)


# ---- policy losses: GSPO and CISPO ----


@pytest.mark.parametrize("loss,extra", [
    # GSPO's loss and gradient are checked against the model itself below; its learning run is slow.
    pytest.param("gspo", ["actor.avg_level=sequence", "adv.norm_var=true"], marks=pytest.mark.slow),
    ("cispo", ["adv.norm_var=true"]),
])
def test_gspo_and_cispo_raise_reward(repeat_model, rl_data, tmp_path, loss, extra):
    """Two mini-batches per rollout, so the second update is off-policy and the ratios leave 1."""
    run_ranks(1, ppo_args(repeat_model, rl_data, tmp_path, f"actor.policy_loss={loss}", "actor.mini_batch_size=2",
                          *extra))
    assert_learned(tmp_path, repeat_model)
    metrics = [m for m in read_metrics(tmp_path) if "actor/loss" in m]
    ratio = {"gspo": "actor/seq_ratio", "cispo": "actor/is_weight"}[loss]
    assert all({"actor/clip_frac_low", "actor/clip_frac_high", ratio} <= set(m) for m in metrics)
    assert any(abs(m[ratio] - 1) > 1e-3 for m in metrics)
    if loss == "gspo":  # the paper's ranges (3e-4, 4e-4) clip a large share of off-policy trajectories
        assert any(m["actor/clip_frac_low"] + m["actor/clip_frac_high"] > 0 for m in metrics)


# Each run is compared with one process of the HF model: the 2-rank run alone shows 2 ranks = 1 rank.
@pytest.mark.parametrize("loss,nproc,layout", [
    ("gspo", 2, "actor.cp_size=1"),
    pytest.param("gspo", 1, "actor.cp_size=1", marks=pytest.mark.slow),
    pytest.param("gspo_token", 1, "actor.cp_size=1", marks=pytest.mark.slow),
    pytest.param("gspo", 2, "actor.cp_size=2", marks=pytest.mark.slow),
    pytest.param("gspo", 2, "actor.tp_size=2", marks=pytest.mark.slow),
])
def test_gspo_over_multi_sequence_trajectories_matches_the_model(tiny_model_path, tmp_path, loss, nproc, layout):
    """One ratio per trajectory of up to three sequences, packed 16 tokens per micro-batch: the actor's
    loss and gradient equal the paper's objective computed with the HF model one sequence at a time."""
    out = tmp_path / "gspo.pt"
    run_ranks(nproc, ["tests/e2e/scripts/gspo_trajectories.py", str(out), f"actor.model_name={tiny_model_path}",
                      "actor.dtype=float32", "actor.max_length_per_device=16", f"actor.policy_loss={loss}",
                      "actor.avg_level=sequence", "actor.gspo.clip_low=0.02", "actor.gspo.clip_high=0.02", layout])
    report = torch.load(out)
    assert max(report["sequences_per_trajectory"]) == 3
    metrics = report["metrics"]
    assert 0 < metrics["actor/clip_frac_low"] + metrics["actor/clip_frac_high"] < 1  # some clipped, some not
    # The loss (~1e-3) is what is left of eight terms of ~1/8 with signs +-: their float32 rounding, not
    # the loss's own size, sets the tolerance.
    assert metrics["actor/loss"] == pytest.approx(report["expected_loss"], rel=1e-4, abs=1e-6)
    for name, expected in report["expected_grads"].items():
        torch.testing.assert_close(report["grads"][name], expected, atol=1e-6, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_trajectory_level_losses_keep_a_trajectory_in_one_micro_batch():
    from RL2.batch import SequenceBatch
    from RL2.workers.actor import trajectory_units

    batch = SequenceBatch(input_ids=[[1, 2, 3], [4, 5], [6, 7, 8, 9], [1, 2]], tokens={"loss_mask": torch.ones(7)},
                          sample_ids=torch.tensor([0, 0, 2, 2]), n_samples=3)
    assert trajectory_units(batch, budget=5, loss="gspo") == [[0, 1], [2, 3]]  # sample 1 has no sequence
    with pytest.raises(ValueError, match="actor.policy_loss=gspo .* a trajectory has 4 tokens, more than .* = 3"):
        trajectory_units(batch, budget=3, loss="gspo")


# ---- the entropy floor of ProRL's reference reset ----

FLOOR = 3.0


def floor_args(model, data, save_dir, *extra):
    return ppo_args(model, data, save_dir, "actor.kl.coef=0.01", "actor.kl.type=reward", "actor.kl.estimator=k1",
                    f"actor.kl.reset_entropy_floor={FLOOR}", "trainer.save_freq=4", *extra)


@pytest.fixture(scope="module")
def floor_run(repeat_model, rl_data, tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("entropy_floor")
    run_ranks(2, floor_args(repeat_model, rl_data, save_dir))
    return save_dir


def test_entropy_floor_resets_the_reference_after_steps_below_it(floor_run):
    """The policy's entropy falls as it learns: steps above the floor keep the initial reference, steps
    below it copy the actor into the reference, so the next step's KL to it is ~0 (also across the
    step-4 checkpoint)."""
    metrics = read_metrics(floor_run)
    resets = [m["actor/ref_reset"] for m in metrics]
    assert resets == [float(m["actor/entropy"] < FLOOR) for m in metrics]
    assert 0.0 in resets and 1.0 in resets, [m["actor/entropy"] for m in metrics]
    for before, after in zip(metrics, metrics[1:]):
        if before["actor/ref_reset"]:
            assert abs(after["actor/ref_kl"]) < 1e-4, after
        elif not any(m["actor/ref_reset"] for m in metrics if m["step"] <= before["step"]):
            assert abs(after["actor/ref_kl"]) > 1e-3, after  # still the initial model, which the actor has left


def test_entropy_floor_run_resumes_exactly(floor_run, repeat_model, rl_data, tmp_path):
    # A run killed after step 5: only the step-4 checkpoint survives, with the reference as reset then.
    assert (floor_run / "step4" / "trainer_state.json").exists()
    resumed = tmp_path / "resumed"
    shutil.copytree(floor_run / "step4", resumed / "step4")
    (resumed / "metrics.jsonl").write_text(
        "".join(json.dumps(m) + "\n" for m in read_metrics(floor_run) if m["step"] <= 5))
    run_ranks(2, floor_args(repeat_model, rl_data, resumed, "trainer.load_ckpt_from=latest"))
    straight, again = read_metrics(floor_run), read_metrics(resumed)
    assert rewards(resumed) == rewards(floor_run)
    for key in ("actor/ref_reset", "actor/loss", "actor/ref_kl"):
        assert [m[key] for m in again] == pytest.approx([m[key] for m in straight], abs=1e-6), key
    expected = load_file(f"{floor_run}/final/actor/model.safetensors")
    for key, value in load_file(f"{resumed}/final/actor/model.safetensors").items():
        torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=1e-5)
