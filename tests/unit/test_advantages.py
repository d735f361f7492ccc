"""Advantage estimators and reward shaping against hand-computed numbers and plain-Python loops."""

import math
import statistics

import pytest
import torch

from RL2.algs.advantages import gae, grpo, masked_whiten, mc, reinforce_plus_plus, rloo
from RL2.algs.reward_shaping import length_penalty, overlong_penalty


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _random_masked_batch(seed: int, batch: int = 5, seq_len: int = 9):
    """Random rewards/values and a mask with a prompt prefix and environment gaps."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, seq_len, generator=g)
    values = torch.randn(batch, seq_len, generator=g)
    mask = (torch.rand(batch, seq_len, generator=g) > 0.3).float()
    mask[:, :2] = 0.0  # prompt
    mask[-1] = 0.0  # a row without any action token
    return rewards, values, mask


def _action_positions(mask_row):
    return [t for t, m in enumerate(mask_row) if m > 0]


# ------------------------------------------------------------------------------------------ GAE


def test_gae_hand_computed_skips_environment_token():
    # Action tokens at t = 0, 1, 3; t = 2 is an environment token whose reward 5 and value 9
    # must be ignored. gamma = 0.9, lamda = 0.8 (gamma * lamda = 0.72).
    # delta_3 = 1 + 0.9 * 0   - 2.0 = -1.0
    # delta_1 = 0 + 0.9 * 2.0 - 1.0 =  0.8   (next action token is t = 3)
    # delta_0 = 0 + 0.9 * 1.0 - 0.5 =  0.4
    # A_3 = -1.0; A_1 = 0.8 + 0.72 * -1.0 = 0.08; A_0 = 0.4 + 0.72 * 0.08 = 0.4576
    # returns = A + V = [0.9576, 1.08, 0, 1.0]
    rewards = _t([[0.0, 0.0, 5.0, 1.0]])
    values = _t([[0.5, 1.0, 9.0, 2.0]])
    mask = _t([[1.0, 1.0, 0.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lamda=0.8)
    torch.testing.assert_close(adv, _t([[0.4576, 0.08, 0.0, -1.0]]))
    torch.testing.assert_close(ret, _t([[0.9576, 1.08, 0.0, 1.0]]))


def _gae_reference(rewards, values, mask, gamma, lamda):
    batch, seq_len = len(rewards), len(rewards[0])
    adv = [[0.0] * seq_len for _ in range(batch)]
    ret = [[0.0] * seq_len for _ in range(batch)]
    for b in range(batch):
        positions = _action_positions(mask[b])
        running, next_value = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            running = delta + gamma * lamda * running
            adv[b][t] = running
            ret[b][t] = running + values[b][t]
            next_value = values[b][t]
    return adv, ret


@pytest.mark.parametrize("seed,gamma,lamda", [(0, 1.0, 1.0), (1, 0.99, 0.95), (2, 0.5, 0.0)])
def test_gae_matches_reference_loop(seed, gamma, lamda):
    rewards, values, mask = _random_masked_batch(seed)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lamda=lamda)
    ref_adv, ref_ret = _gae_reference(
        rewards.tolist(), values.tolist(), mask.tolist(), gamma, lamda
    )
    torch.testing.assert_close(adv, _t(ref_adv))
    torch.testing.assert_close(ret, _t(ref_ret))


# ------------------------------------------------------------------------ GRPO / Dr. GRPO / RLOO

# Two prompts with four samples each.
SCORES = [[1.0, 0.0, 1.0, 1.0], [0.0, 2.0, 2.0, 0.0]]
# Prompt 0: mean 0.75, unbiased std sqrt(0.75 / 3) = 0.5. Prompt 1: mean 1, unbiased std sqrt(4 / 3).
DR_GRPO = [[0.25, -0.75, 0.25, 0.25], [-1.0, 1.0, 1.0, -1.0]]
GRPO = [[a / (0.5 + 1e-6) for a in DR_GRPO[0]], [a / (math.sqrt(4 / 3) + 1e-6) for a in DR_GRPO[1]]]


def test_dr_grpo_group_mean_baseline():
    torch.testing.assert_close(grpo(_t(SCORES), norm_var=False), _t(DR_GRPO))


def test_grpo_divides_by_unbiased_group_std():
    torch.testing.assert_close(grpo(_t(SCORES), norm_var=True), _t(GRPO))


def test_rloo_leave_one_out_baseline():
    # Prompt 0: 1 - (0 + 1 + 1) / 3 = 1/3; 0 - 1 = -1. Prompt 1: 0 - 4/3; 2 - 2/3 = 4/3.
    expected = [[1 / 3, -1.0, 1 / 3, 1 / 3], [-4 / 3, 4 / 3, 4 / 3, -4 / 3]]
    torch.testing.assert_close(rloo(_t(SCORES)), _t(expected))


def test_a_group_of_one_sample_gets_no_advantage():
    one = _t([[3.0], [1.0]])
    for advantages in (grpo(one, norm_var=False), grpo(one, norm_var=True), rloo(one)):
        torch.testing.assert_close(advantages, torch.zeros(2, 1))


# Shaped rewards (0.1 for the format, 0.7 for a partly right answer) are not dyadic: the float32
# mean of eight equal ones is one ulp off, and dividing that by a std of the same size gave every
# sample of the group +0.056 (0.7) or -0.0147 (0.2) instead of 0.
EQUAL_GROUPS = [[0.7] * 8, [0.2] * 8, [0.1] * 8]
# An ordinary group: mean 3.4 / 8 = 0.425, deviations 0.275, -0.225, -0.325, sum of squares
# 4 * 0.275^2 + 2 * 0.225^2 + 2 * 0.325^2 = 0.615, unbiased std sqrt(0.615 / 7) (GRPO, eq. of sec. 4.1.2).
MIXED = [0.7, 0.2, 0.1, 0.7, 0.1, 0.2, 0.7, 0.7]
MIXED_DEVIATIONS = [0.275, -0.225, -0.325, 0.275, -0.325, -0.225, 0.275, 0.275]
MIXED_STD = math.sqrt(0.615 / 7)


def test_a_group_of_equal_non_dyadic_scores_gets_exactly_zero():
    scores = _t(EQUAL_GROUPS + [MIXED])
    for advantages in (grpo(scores, norm_var=True), grpo(scores, norm_var=False), rloo(scores)):
        assert torch.equal(advantages[:3], torch.zeros(3, 8)), advantages[:3]
    torch.testing.assert_close(grpo(scores, norm_var=True)[3], _t([d / (MIXED_STD + 1e-6) for d in MIXED_DEVIATIONS]))
    torch.testing.assert_close(grpo(scores, norm_var=False)[3], _t(MIXED_DEVIATIONS))
    # RLOO: s_i - (3.4 - s_i) / 7 = (8 s_i - 3.4) / 7 = 8 / 7 of the deviation from the group mean.
    torch.testing.assert_close(rloo(scores)[3], _t([d * 8 / 7 for d in MIXED_DEVIATIONS]))


def test_whitening_equal_non_dyadic_values_gives_exactly_zero():
    # Eight masked entries (prompt tokens and a gap left out): their float32 mean is one ulp off
    # `value`, and the old whitening turned 0.7s into 0.856 each.
    mask = _t([[0.0, 1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]])
    for value in (0.7, 0.2, 0.1):
        x = torch.full((2, 6), value)
        x[0, 0] = 5.0  # unmasked entries take no part
        assert torch.equal(masked_whiten(x, mask), torch.zeros(2, 6))
        # REINFORCE++ with gamma = 1 and the same outcome reward on every row: every return is `value`.
        rewards = torch.zeros(2, 6)
        rewards[:, -1] = value
        assert torch.equal(reinforce_plus_plus(rewards, mask, gamma=1.0), torch.zeros(2, 6))


# ------------------------------------------------------------------------------------ REINFORCE++


def test_reinforce_plus_plus_hand_computed():
    # gamma = 0.5. Row 0: rewards [0, 0, 1] -> returns [0.25, 0.5, 1].
    # Row 1: prompt token first, rewards [_, 0, 2] -> returns [_, 1, 2].
    # Masked returns 0.25, 0.5, 1, 1, 2: mean 0.95, population variance 1.8 / 5 = 0.36, std 0.6.
    rewards = _t([[0.0, 0.0, 1.0], [7.0, 0.0, 2.0]])
    mask = _t([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    adv = reinforce_plus_plus(rewards, mask, gamma=0.5)
    expected = [
        [(0.25 - 0.95) / 0.6, (0.5 - 0.95) / 0.6, 0.05 / 0.6],
        [0.0, 0.05 / 0.6, 1.05 / 0.6],
    ]
    torch.testing.assert_close(adv, _t(expected))


@pytest.mark.parametrize("seed,gamma", [(3, 1.0), (4, 0.9)])
def test_reinforce_plus_plus_matches_reference_loop(seed, gamma):
    rewards, _, mask = _random_masked_batch(seed)
    rewards_l, mask_l = rewards.tolist(), mask.tolist()
    returns = [[0.0] * len(row) for row in rewards_l]
    for b, row in enumerate(rewards_l):
        running = 0.0
        for t in reversed(_action_positions(mask_l[b])):
            running = row[t] + gamma * running
            returns[b][t] = running
    masked = [returns[b][t] for b in range(len(rewards_l)) for t in _action_positions(mask_l[b])]
    mean, std = statistics.fmean(masked), statistics.pstdev(masked)
    expected = [
        [(returns[b][t] - mean) / (std + 1e-8) if mask_l[b][t] else 0.0 for t in range(len(row))]
        for b, row in enumerate(rewards_l)
    ]
    torch.testing.assert_close(reinforce_plus_plus(rewards, mask, gamma=gamma), _t(expected))


# ----------------------------------------------------------------------------- multi-turn returns


def test_mc_full_and_truncated_returns():
    # gamma = 0.5, turns [1, 2, 3] then a padding turn.
    # Full: R2 = 3, R1 = 2 + 0.5 * 3 = 3.5, R0 = 1 + 0.5 * 3.5 = 2.75.
    # Truncated to 2 turns: R0 = 1 + 0.5 * 2 = 2, R1 = 3.5, R2 = 3.
    turn_rewards = _t([[1.0, 2.0, 3.0, 4.0]])
    turn_mask = _t([[1.0, 1.0, 1.0, 0.0]])
    full = mc(turn_rewards, turn_mask, gamma=0.5)
    truncated = mc(turn_rewards, turn_mask, gamma=0.5, truncation=2)
    torch.testing.assert_close(full, _t([[2.75, 3.5, 3.0, 0.0]]))
    torch.testing.assert_close(truncated, _t([[2.0, 3.5, 3.0, 0.0]]))


def test_mc_skips_masked_turns_and_rejects_bad_truncation():
    # The middle turn is masked: R0 = 1 + 0.5 * 2 = 2 (no discount step for the skipped turn).
    out = mc(_t([[1.0, 9.0, 2.0]]), _t([[1.0, 0.0, 1.0]]), gamma=0.5)
    torch.testing.assert_close(out, _t([[2.0, 0.0, 2.0]]))
    with pytest.raises(ValueError, match="truncation"):
        mc(_t([[1.0]]), _t([[1.0]]), truncation=0)


def test_masked_whiten_over_the_masked_entries_only():
    x, mask = _t([1.0, 3.0, 100.0, 5.0]), _t([1.0, 1.0, 0.0, 1.0])
    mean, std = 3.0, statistics.pstdev([1.0, 3.0, 5.0])
    expected = [(1 - mean) / (std + 1e-8), 0.0, 0.0, (5 - mean) / (std + 1e-8)]
    torch.testing.assert_close(masked_whiten(x, mask), _t(expected))


# ----------------------------------------------------------------------------------- reward shaping


def test_overlong_penalty_dapo():
    # max_new_tokens 16, buffer 4: no penalty up to 12, linear to -factor at 16, -factor beyond.
    lengths = torch.tensor([10, 12, 14, 16, 20])
    out = overlong_penalty(lengths, max_new_tokens=16, buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(out, _t([0.0, 0.0, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_new_tokens=16, buffer_len=0)


def test_length_penalty():
    lengths = torch.tensor([10, 20])
    torch.testing.assert_close(length_penalty(lengths, coef=0.01), _t([-0.1, -0.2]))
    torch.testing.assert_close(
        length_penalty(lengths, coef=0.01, max_new_tokens=40), _t([-0.0025, -0.005])
    )
