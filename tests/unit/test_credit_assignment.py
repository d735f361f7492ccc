"""Multi-turn credit assignment: a trajectory is one sample, however many sequences it spans.

Trajectories are built by hand (`Trajectory`/`Turn`, no engine) and turned into the training batch
the trainer uses; advantages are compared with hand-computed numbers and with plain-Python loops
over each trajectory's turns and tokens.
"""

import statistics

import pytest
import torch
from omegaconf import OmegaConf

from RL2.config.cli import parse_config
from RL2.config.errors import ConfigError
from RL2.config.ppo_schema import PPOConfig, check_algorithm
from RL2.packing import train_weights
from RL2.rollout.trajectory import Trajectory, Turn, training_batch
from RL2.trainer.ppo_advantages import add_advantages, add_reward_model_scores, shape_rewards

KL_OFF = OmegaConf.create({"coef": 0.0, "type": "loss", "estimator": "k3"})
PROMPT, OBSERVATION = [1, 2, 3], [7, 7]


def adv_cfg(estimator: str, **overrides):
    defaults = {"estimator": estimator, "gamma": 1.0, "lamda": 1.0, "norm_var": False, "global_norm": False,
                "truncation": None, "baseline": "group"}
    return OmegaConf.create(defaults | overrides)


def trajectory(*sequences: list[int], rewards: list[float]) -> Trajectory:
    """`sequences`: for each sequence, the sampled tokens of each of its turns (an observation of 2
    tokens follows every turn but a sequence's last); `rewards`: one per turn, in order."""
    t = Trajectory(extra_info={}, stop_reason="done")
    turn = 0
    for lengths in sequences:
        t.start_sequence("prompt", PROMPT)
        for i, n in enumerate(lengths):
            t.add_turn(Turn([20 + turn] * n, [-0.5] * n, f"action {turn}", "stop", reward=rewards[turn]))
            if i + 1 < len(lengths):
                t.continue_sequence("observation", OBSERVATION)
            turn += 1
    return t


def sampled(batch, name: str = "advantages") -> list[list[float]]:
    """Per sequence, `name` at its sampled tokens."""
    return [batch.sequence(name, i)[batch.sequence("loss_mask", i) > 0].tolist() for i in range(len(batch.input_ids))]


def issue_example():
    """Trajectory A spans two sequences (turn rewards 0 then 1); B is one sequence with reward 0."""
    return [[trajectory([2], [2], rewards=[0.0, 1.0]), trajectory([2], rewards=[0.0])]]


def with_zero_values(batch):
    batch.tokens["values"] = torch.zeros(batch.n_labels)
    return batch


def test_a_trajectory_of_two_sequences_is_one_sample():
    batch = training_batch([[trajectory([2, 1], [3], rewards=[1.0, 2.0, 4.0])], [trajectory([1], rewards=[0.5])]])
    assert batch.input_ids == [PROMPT + [20, 20] + OBSERVATION + [21], PROMPT + [22, 22, 22], PROMPT + [20]]
    # Labels: token t of a sequence is label t - 1, so the first prompt token is never one.
    assert batch.sequence("loss_mask", 0).tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert batch.sequence("turn_ids", 0).tolist() == [-1, -1, 0, 0, -1, -1, 1]
    assert batch.sequence("turn_ids", 1).tolist() == [-1, -1, 2, 2, 2]
    assert batch.sequence("engine_logps", 1).tolist() == [0.0, 0.0, -0.5, -0.5, -0.5]
    assert batch.sample_ids.tolist() == [0, 0, 1] and batch.n_samples == 2
    assert batch.group_ids.tolist() == [0, 1]
    assert batch.rewards.tolist() == [7.0, 0.5] and batch.response_lengths.tolist() == [6.0, 1.0]
    assert batch.turn_rewards.tolist() == [[1.0, 2.0, 4.0], [0.5, 0.0, 0.0]]
    assert batch.turn_mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]


WHITE_HIGH, WHITE_LOW = (1 - 2 / 3) / (2 / 9) ** 0.5, (0 - 2 / 3) / (2 / 9) ** 0.5


@pytest.mark.parametrize("estimator,overrides,expected", [
    # Dr. GRPO: A is one of the group's G = 2 outputs: 1 - 0.5 and 0 - 0.5.
    ("grpo", {}, [0.5, 0.5, -0.5]),
    # GRPO: divided by the group's unbiased std sqrt(0.5).
    ("grpo", {"norm_var": True}, [0.5 / (0.5**0.5 + 1e-6)] * 2 + [-0.5 / (0.5**0.5 + 1e-6)]),
    # RLOO: the baseline of A leaves out all of A's sequences: 1 - 0 and 0 - 1.
    ("rloo", {}, [1.0, 1.0, -1.0]),
    ("raw", {}, [1.0, 1.0, 0.0]),
    # GAE with gamma = lamda = 1 and V = 0: the return runs over the whole episode.
    ("gae", {}, [1.0, 1.0, 0.0]),
    # REINFORCE++: returns 1, 1 | 1, 1 | 0, 0 whitened over the batch's tokens (mean 2/3, std sqrt(2/9)).
    ("reinforce_plus_plus", {}, [WHITE_HIGH, WHITE_HIGH, WHITE_LOW]),
    ("mc", {}, [1.0, 1.0, 0.0]),
])
def test_every_estimator_treats_a_trajectory_as_one_sample(estimator, overrides, expected):
    batch = with_zero_values(training_batch(issue_example()))
    add_advantages(batch, adv_cfg(estimator, **overrides), KL_OFF)
    assert sampled(batch) == [pytest.approx([v, v], rel=1e-5) for v in expected]


@pytest.mark.parametrize("norm_var,high,low", [
    ("false", 0.5, -0.5),  # A and B minus the group mean 0.5
    ("true", 0.5 / (0.5**0.5 + 1e-6), -0.5 / (0.5**0.5 + 1e-6)),  # divided by the unbiased std sqrt(0.5)
])
def test_reinforce_is_another_spelling_of_grpo(norm_var, high, low):
    """adv.estimator=reinforce (the original RL2's name) selects GRPO: both spellings give the same advantages."""
    for spelling in ("grpo", "reinforce"):
        cfg = parse_config(PPOConfig, "ppo", [f"adv.estimator={spelling}", f"adv.norm_var={norm_var}"])
        assert cfg.adv.estimator == "grpo"
        batch = training_batch(issue_example())
        add_advantages(batch, cfg.adv, cfg.actor.kl)
        assert sampled(batch) == [pytest.approx([high, high], rel=1e-5), pytest.approx([high, high], rel=1e-5),
                                  pytest.approx([low, low], rel=1e-5)], spelling


def test_gae_bootstraps_a_sequence_from_the_next_one():
    # gamma = 0.5, lamda = 1, V = 0 on A: the reward 1 at A's last token is discounted back over
    # A's second sequence and on into its first (the observation between them is no step).
    batch = with_zero_values(training_batch(issue_example()))
    add_advantages(batch, adv_cfg("gae", gamma=0.5), KL_OFF)
    assert sampled(batch) == [pytest.approx([0.125, 0.25]), pytest.approx([0.5, 1.0]), [0.0, 0.0]]
    assert sampled(batch, "returns") == sampled(batch)


def _per_trajectory_gae(trajectory_tokens, gamma, lamda):
    """Plain-Python GAE over one trajectory's sampled tokens, all sequences in order:
    [(reward, value)] -> [(advantage, return)]."""
    out, running, next_value = [], 0.0, 0.0
    for reward, value in reversed(trajectory_tokens):
        delta = reward + gamma * next_value - value
        running = delta + gamma * lamda * running
        out.append((running, running + value))
        next_value = value
    return out[::-1]


@pytest.mark.parametrize("gamma,lamda", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_over_random_multi_sequence_trajectories_matches_a_per_trajectory_loop(gamma, lamda):
    g = torch.Generator().manual_seed(0)
    groups = [[trajectory([2, 3], [1], [2, 2], rewards=[0.3, -1.0, 0.5, 2.0, 1.0]), trajectory([4], rewards=[1.5])],
              [trajectory([1], [1], rewards=[0.0, 1.0]), trajectory([3, 1], rewards=[2.0, -0.5])]]
    batch = training_batch(groups)
    batch.tokens["values"] = torch.randn(batch.n_labels, generator=g) * batch.tokens["loss_mask"]
    add_advantages(batch, adv_cfg("gae", gamma=gamma, lamda=lamda), KL_OFF)
    for sample, t in enumerate(t for group in groups for t in group):
        sequences = [i for i in range(len(batch.input_ids)) if batch.sample_ids[i] == sample]
        values = [v for i in sequences
                  for v in batch.sequence("values", i)[batch.sequence("loss_mask", i) > 0].tolist()]
        rewards = [0.0] * len(values)
        ends = [sum(len(turn.action_ids) for turn in t.turns[: k + 1]) - 1 for k in range(t.n_turns)]
        for turn, end in zip(t.turns, ends):
            rewards[end] = turn.reward  # each turn's reward on its last sampled token
        expected = _per_trajectory_gae(list(zip(rewards, values)), gamma, lamda)
        got = [v for i in sequences for v in sampled(batch)[i]]
        got_returns = [v for i in sequences for v in sampled(batch, "returns")[i]]
        assert got == pytest.approx([a for a, _ in expected], abs=1e-5)
        assert got_returns == pytest.approx([r for _, r in expected], abs=1e-5)


def test_turns_in_one_sequence_get_their_rewards_at_their_ends():
    # Two turns in one sequence, rewards 1 and 2: each reward arrives at the end of its turn.
    batch = with_zero_values(training_batch([[trajectory([2, 2], rewards=[1.0, 2.0])]]))
    add_advantages(batch, adv_cfg("gae"), KL_OFF)
    assert sampled(batch) == [pytest.approx([3.0, 3.0, 2.0, 2.0])]


def test_monte_carlo_returns_per_turn_across_sequences():
    # gamma = 0.5, turns 1 | 2 in two sequences, then B with 4: R0 = 1 + 0.5 * 2 = 2, R1 = 2.
    groups = [[trajectory([2], [1], rewards=[1.0, 2.0]), trajectory([2], rewards=[4.0])]]
    batch = training_batch(groups)
    add_advantages(batch, adv_cfg("mc", gamma=0.5), KL_OFF)
    assert sampled(batch) == [[2.0, 2.0], [2.0], [4.0, 4.0]]
    batch = training_batch(groups)
    add_advantages(batch, adv_cfg("mc", gamma=0.5, truncation=1), KL_OFF)
    assert sampled(batch) == [[1.0, 1.0], [2.0], [4.0, 4.0]]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "raw", "gae", "mc"])
def test_global_norm_whitens_every_estimator_over_the_sampled_tokens(estimator):
    plain, normed = (with_zero_values(training_batch(issue_example())) for _ in range(2))
    add_advantages(plain, adv_cfg(estimator), KL_OFF)
    add_advantages(normed, adv_cfg(estimator, global_norm=True), KL_OFF)
    tokens = [v for seq in sampled(plain) for v in seq]
    mean, std = statistics.fmean(tokens), statistics.pstdev(tokens)
    expected = [[(v - mean) / (std + 1e-8) for v in seq] for seq in sampled(plain)]
    assert sampled(normed) == [pytest.approx(seq, abs=1e-5) for seq in expected]


@pytest.mark.parametrize("norm_var,expected", [
    # Scores 1, 0 | 1, 1: the batch mean 0.75 is every trajectory's baseline (the group's would give
    # 0.5, -0.5 | 0, 0), and with norm_var the batch's unbiased std 0.5 divides, as the original RL2 did.
    (False, [0.25, -0.75, 0.25, 0.25]),
    (True, [0.25 / (0.5 + 1e-6), -0.75 / (0.5 + 1e-6), 0.25 / (0.5 + 1e-6), 0.25 / (0.5 + 1e-6)]),
])
def test_batch_baseline_compares_every_score_with_the_batch(norm_var, expected):
    batch = training_batch([[trajectory([1], rewards=[1.0]), trajectory([1], rewards=[0.0])],
                            [trajectory([1], rewards=[1.0]), trajectory([1], rewards=[1.0])]])
    add_advantages(batch, adv_cfg("grpo", baseline="batch", norm_var=norm_var), KL_OFF)
    assert sampled(batch) == [pytest.approx([v], rel=1e-5) for v in expected]


@pytest.mark.parametrize("estimator,overrides", [
    ("grpo", {"norm_var": True}), ("grpo", {}), ("rloo", {}), ("grpo", {"global_norm": True}),
    ("grpo", {"baseline": "batch", "norm_var": True}),
    ("reinforce_plus_plus", {}),
])
def test_a_group_of_equal_shaped_rewards_gets_exactly_zero(estimator, overrides):
    # Sixteen trajectories scored 0.7 each (0.6 for the answer plus 0.1 for the format): the old
    # float32 group mean was one ulp off, and GRPO's division by the group std gave each +0.056.
    # REINFORCE++ whitens per-token returns, so there every trajectory is one turn (return 0.7
    # everywhere); the group estimators score whole trajectories, so the first group has two turns.
    turns = ([1], dict(rewards=[0.7])) if estimator == "reinforce_plus_plus" else ([2], [1], dict(rewards=[0.6, 0.1]))
    group = [trajectory(*turns[:-1], **turns[-1]) for _ in range(8)]
    batch = training_batch([group, [trajectory([1], rewards=[0.7]) for _ in range(8)]])
    add_advantages(batch, adv_cfg(estimator, **overrides), KL_OFF)
    assert all(v == 0.0 for seq in sampled(batch) for v in seq), sampled(batch)


def test_shaping_is_added_once_per_trajectory():
    cfg = OmegaConf.create({"train_sampling_params": {"max_new_tokens": 4}, "overlong_buffer_len": 2,
                            "overlong_penalty_factor": 1.0, "length_penalty_coef": 0.8})
    batch = training_batch(issue_example())  # A samples 4 tokens over its two sequences, B 2
    metrics = shape_rewards(batch, cfg)
    # Overlong: none up to 4 - 2 = 2 tokens, then -(n - 2) / 2; length: -0.8 * n / 4.
    penalty_a, penalty_b = -1.0 - 0.8, 0.0 - 0.4
    assert batch.rewards.tolist() == pytest.approx([1.0 + penalty_a, penalty_b])
    torch.testing.assert_close(batch.turn_rewards, torch.tensor([[0.0, 1.0 + penalty_a], [penalty_b, 0.0]]))
    assert metrics["rollout/overlong_penalty"] == pytest.approx(-0.5)
    # The token-level estimators see the penalty once too: A's return is 1 + penalty_a.
    with_zero_values(batch)
    add_advantages(batch, adv_cfg("gae"), KL_OFF)
    assert sampled(batch) == [pytest.approx([1.0 + penalty_a] * 2)] * 2 + [pytest.approx([penalty_b] * 2)]


def test_reward_model_scores_are_added_once_per_trajectory():
    batch = training_batch(issue_example())
    metrics = add_reward_model_scores(batch, torch.tensor([0.25, -0.75]))
    assert metrics["rollout/reward_model_score"] == pytest.approx(-0.25)
    assert batch.rewards.tolist() == [1.25, -0.75]
    add_advantages(batch, adv_cfg("mc"), KL_OFF)
    assert sampled(batch) == [[1.25, 1.25], [1.25, 1.25], [-0.75, -0.75]]


def test_kl_and_teacher_penalties_in_the_reward():
    """Per-token penalties: the KL (k1, in the reward) and the teacher's reverse KL, summed per
    trajectory for grpo and per turn for mc."""
    batch = training_batch([[trajectory([2], [1], rewards=[0.0, 1.0]), trajectory([1], rewards=[0.0])]])
    mask = batch.tokens["loss_mask"]
    positions = mask.nonzero()[:, 0]  # sampled tokens: A's 2 + 1, then B's 1
    old = torch.zeros(batch.n_labels).index_put((positions,), torch.tensor([-1.0, -2.0, -1.0, -0.5]))
    batch.tokens["old_logps"] = old
    batch.tokens["ref_logps"] = old.index_put((positions,), torch.tensor([-1.5, -1.0, -1.0, -0.5]))
    batch.tokens["teacher_logps"] = old.index_put((positions,), torch.tensor([-1.0, -2.0, -2.0, -1.5]))
    kl = OmegaConf.create({"coef": 0.5, "type": "reward", "estimator": "k1"})
    # Penalties 0.5 * (old - ref) + 1.0 * (old - teacher) = [0.25, -0.5, 1.0, 1.0] on A's then B's tokens.
    add_advantages(batch, adv_cfg("raw"), kl, teacher_coef=1.0)
    assert sampled(batch) == [pytest.approx([1 - 0.75] * 2), pytest.approx([1 - 0.75]), pytest.approx([-1.0])]
    # mc: A's turn 0 pays -0.25, turn 1 pays 1.0: R1 = 1 - 1 = 0, R0 = 0.25 + 0 ... (gamma = 1).
    add_advantages(batch, adv_cfg("mc"), kl, teacher_coef=1.0)
    assert sampled(batch) == [pytest.approx([0.25, 0.25]), pytest.approx([0.0]), pytest.approx([-1.0])]


def test_sequence_and_constant_averages_count_trajectories():
    batch = training_batch(issue_example())  # A: 2 + 2 tokens in two sequences; B: 2 tokens
    by_sequence = [w[m > 0].tolist()
                   for w, m in ((train_weights(batch, "sequence")[batch.offsets[i]:batch.offsets[i + 1]],
                                 batch.sequence("loss_mask", i)) for i in range(3))]
    assert by_sequence == [pytest.approx([1 / 8] * 2)] * 2 + [pytest.approx([1 / 4] * 2)]
    constant = train_weights(batch, "constant", response_budget=10)
    assert constant[batch.tokens["loss_mask"] > 0].tolist() == pytest.approx([1 / 20] * 6)


def test_mini_batches_keep_whole_groups():
    groups = [[trajectory([1], [1], rewards=[0.0, 1.0]), trajectory([1], rewards=[1.0])],
              [trajectory([2], rewards=[0.0]), trajectory([1], [1], [1], rewards=[0.0, 0.0, 3.0])]]
    batch = training_batch(groups)
    first, second = batch.mini_batches(1)
    assert (first.n_samples, second.n_samples) == (2, 2)
    assert first.input_ids == batch.input_ids[:3] and second.input_ids == batch.input_ids[3:]
    assert second.sample_ids.tolist() == [0, 1, 1, 1] and second.group_ids.tolist() == [0, 0]
    assert second.rewards.tolist() == [0.0, 3.0] and second.turn_rewards[1].tolist() == [0.0, 0.0, 3.0]
    torch.testing.assert_close(second.tokens["loss_mask"], batch.tokens["loss_mask"][int(batch.offsets[3]):])


@pytest.mark.parametrize("adv,kl,message", [
    ({"estimator": "rloo", "norm_var": True}, {}, "adv.norm_var divides GRPO's group baseline"),
    ({"estimator": "reinforce_plus_plus", "global_norm": True}, {}, "already whitens"),
    ({"estimator": "grpo", "lamda": 0.95}, {}, "adv.lamda is GAE's lambda"),
    ({"estimator": "rloo", "gamma": 0.9}, {}, "nothing to discount"),
    ({"estimator": "gae", "truncation": 2}, {}, "adv.truncation"),
    ({"estimator": "reinforce_plus_plus"}, {"coef": 0.01, "type": "reward", "estimator": "k3"}, "biased KL gradient"),
    ({"estimator": "grpo"}, {"coef": 0.01, "type": "loss", "estimator": "k1"}, "zero gradient in expectation"),
])
def test_contradictory_settings_fail_with_the_reason(adv, kl, message):
    kl = OmegaConf.create({"coef": 0.0, "type": "loss", "estimator": "k3"} | kl)
    with pytest.raises(ConfigError, match=message):
        check_algorithm(adv_cfg(**adv), kl)


@pytest.mark.parametrize("adv,kl", [
    ({"estimator": "gae", "lamda": 0.95, "global_norm": True}, {"coef": 0.05, "type": "reward", "estimator": "k1"}),
    ({"estimator": "grpo", "norm_var": True}, {"coef": 0.04, "type": "loss", "estimator": "k3"}),
    ({"estimator": "reinforce_plus_plus", "gamma": 0.99}, {"coef": 0.01, "type": "reward", "estimator": "k1"}),
    ({"estimator": "mc", "gamma": 0.9, "truncation": 2}, {"coef": 0.01, "type": "reward", "estimator": "k1"}),
])
def test_the_recipes_pass(adv, kl):
    check_algorithm(adv_cfg(**adv), OmegaConf.create(kl))


# ---- faulted trajectories: out of training by default (rollout.train_on_faults=true trains them as reward 0) ----


def faulted(t: Trajectory) -> Trajectory:
    t.fail("step raised ValueError: a bug of the environment's")
    return t


def fault_groups():
    """Group 0: A (reward 1), B (faulted after earning 5), C (0), D (0.5); group 1: every one faulted."""
    return [[trajectory([2], rewards=[1.0]), faulted(trajectory([1], [2], rewards=[5.0, 0.0])),
             trajectory([1], rewards=[0.0]), trajectory([3], rewards=[0.5])],
            [faulted(trajectory([2], rewards=[1.0])) for _ in range(2)] + [faulted(trajectory([1], rewards=[0.0]))
                                                                            for _ in range(2)]]


STD_ACD = (((1 - 0.5) ** 2 + (0 - 0.5) ** 2 + 0) / 2) ** 0.5  # over the group's unfaulted A, C, D (mean 0.5)


@pytest.mark.parametrize("estimator,overrides,expected", [
    ("grpo", {}, [0.5, -0.5, 0.0]),
    ("grpo", {"norm_var": True}, [0.5 / (STD_ACD + 1e-6), -0.5 / (STD_ACD + 1e-6), 0.0]),
    ("rloo", {}, [1 - 0.25, 0 - 0.75, 0.5 - 0.5]),
])
def test_a_group_baseline_is_over_its_unfaulted_trajectories(estimator, overrides, expected):
    batch = training_batch(fault_groups())
    assert batch.trained.tolist() == [True, False, True, True] + [False] * 4
    assert batch.sample_ids.tolist() == [0, 2, 3]  # B's two sequences and group 1's faulted ones are not trained
    add_advantages(batch, adv_cfg(estimator, **overrides), KL_OFF)
    assert sampled(batch) == [pytest.approx([v] * n, abs=1e-6) for v, n in zip(expected, (2, 1, 3))]


def test_train_on_faults_trains_them_as_reward_0():
    batch = training_batch(fault_groups(), train_on_faults=True)
    assert batch.trained.all() and batch.sample_ids.tolist() == [0, 1, 1, 2, 3, 4, 5, 6, 7]
    add_advantages(batch, adv_cfg("grpo"), KL_OFF)
    mean = (1 + 0 + 0 + 0.5) / 4  # B counts with reward 0
    assert sampled(batch) == [pytest.approx([1 - mean] * 2), pytest.approx([-mean]), pytest.approx([-mean] * 2),
                              pytest.approx([-mean]), pytest.approx([0.5 - mean] * 3)] + [[0.0] * 2] * 2 + [[0.0]] * 2


@pytest.mark.parametrize("level", ["token", "sequence", "constant"])
def test_the_loss_of_a_batch_with_faults_is_that_of_its_other_trajectories(level):
    """PPO's clipped loss under GRPO, computed by the trainer's functions on the batch with faults, equals the
    formula over the unfaulted trajectories A, C, D alone (log-probabilities drawn per token id)."""
    from RL2.algs.policy_loss import ppo_loss

    logp, old_logp = {20: -0.3, 21: -1.2}, {20: -0.5, 21: -1.0}
    batch = training_batch(fault_groups())
    add_advantages(batch, adv_cfg("grpo"), KL_OFF)
    labels = [t for ids in batch.input_ids for t in ids[1:]]
    lookup = {name: torch.tensor([table.get(t, 0.0) for t in labels]) for name, table in
              (("logps", logp), ("old", old_logp))}
    losses, _ = ppo_loss(lookup["logps"], lookup["old"], batch.tokens["advantages"], batch.tokens["loss_mask"])
    loss = (losses * train_weights(batch, level, response_budget=10)).sum()

    def token_loss(advantage, token):
        ratio = torch.tensor(logp[token] - old_logp[token]).exp()
        return -min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)

    # A, C, D: (advantage, sampled tokens), the advantage their reward less the mean 0.5 of the three
    kept = [(0.5, [20, 20]), (-0.5, [20]), (0.0, [20, 20, 20])]
    per_token = [[token_loss(a, tok) for tok in tokens] for a, tokens in kept]
    expected = {"token": sum(map(sum, per_token)) / 6, "sequence": sum(sum(p) / len(p) for p in per_token) / 3,
                "constant": sum(map(sum, per_token)) / (10 * 3)}[level]
    assert loss.item() == pytest.approx(float(expected), rel=1e-5)


def test_dynamic_filtering_reads_the_trained_rewards_only():
    from RL2.rollout.loop import filter_groups

    equal_but_a_fault = [trajectory([1], rewards=[1.0]), faulted(trajectory([1], rewards=[1.0]))]
    assert filter_groups([equal_but_a_fault]) == []
    assert filter_groups([equal_but_a_fault], train_on_faults=True) == [equal_but_a_fault]


def test_a_mini_batch_of_faults_only_has_nothing_to_train():
    first, second = training_batch(fault_groups()).mini_batches(1)
    assert (first.n_trained, second.n_trained, second.input_ids) == (3, 0, [])
    for level in ("token", "sequence", "constant"):  # weights over A, C, D only; none (and no NaN) for the faults
        assert train_weights(first, level, response_budget=10).sum().item() == pytest.approx(
            {"token": 1.0, "sequence": 1.0, "constant": 6 / 30}[level])
        assert train_weights(second, level, response_budget=10).numel() == 0
