"""KL estimators, the PPO policy/value losses, loss averaging and entropy on hand-made tensors."""

import math

import pytest
import torch

from RL2.algs.kl import KL_ESTIMATORS, compute_kl, k1, k2, k3
from RL2.algs.averaging import AVERAGING_LEVELS, loss_weights
from RL2.algs.policy_loss import (
    entropy_from_logits,
    policy_loss,
    truncated_is_weights,
    value_loss,
)


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


# ------------------------------------------------------------------------------------------- KL


def test_kl_estimators_match_formulas():
    # log r = logp - ref_logp = [0.5, -1.0, 0.0]
    logps, ref = _t([-1.0, -2.0, -0.5]), _t([-1.5, -1.0, -0.5])
    torch.testing.assert_close(k1(logps, ref), _t([0.5, -1.0, 0.0]))
    torch.testing.assert_close(k2(logps, ref), _t([0.125, 0.5, 0.0]))
    expected_k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0, 0.0]
    torch.testing.assert_close(k3(logps, ref), _t(expected_k3))
    torch.testing.assert_close(compute_kl("k3", logps, ref), _t(expected_k3))


def test_k3_is_non_negative_and_clamp_avoids_overflow():
    g = torch.Generator().manual_seed(0)
    assert (k3(3 * torch.randn(1000, generator=g), 3 * torch.randn(1000, generator=g)) >= 0).all()
    logps, ref = _t([-200.0]), _t([0.0])
    assert torch.isinf(k3(logps, ref)).all()
    clamped = k3(logps, ref, log_ratio_clamp=20.0)
    torch.testing.assert_close(clamped, _t([math.exp(20.0) - 1 - 20.0]))


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_average_to_exact_kl(name):
    p, q = [0.5, 0.3, 0.2], [0.2, 0.3, 0.5]
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))  # 0.3 * ln 2.5 ~ 0.2749
    g = torch.Generator().manual_seed(0)
    samples = torch.multinomial(_t(p), 200_000, replacement=True, generator=g)
    logp, logq = _t(p).log()[samples], _t(q).log()[samples]
    # Standard error of either mean is below 0.002 here; allow five times that.
    assert abs(compute_kl(name, logp, logq).mean().item() - exact) < 0.01


def test_unknown_kl_estimator_lists_names():
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    with pytest.raises(ValueError, match="valid names.*'k1'"):
        compute_kl("k4", _t([0.0]), _t([0.0]))


# ------------------------------------------------------------------------------ PPO policy loss

# One row, clip_low 0.2, clip_high 0.28, old_logps 0 so ratio = exp(logps):
#  t  ratio  A    -A*r   -A*clip(r)  loss   note
#  0  1.5   +1   -1.5   -1.28       -1.28  clipped high
#  1  0.5   -1    0.5    0.8         0.8   clipped low
#  2  1.1   +2   -2.2   -2.2        -2.2
#  3  0.7   +1   -0.7   -0.8        -0.7   low ratio but A > 0: unclipped term wins
#  4  4.0   -1    4.0    1.28        4.0   dual clip 3 bounds it by -3 * A = 3
#  5  1.5   +1   (mask 0: would be clipped high, must not count)
RATIOS = [1.5, 0.5, 1.1, 0.7, 4.0, 1.5]
ADVS = [1.0, -1.0, 2.0, 1.0, -1.0, 1.0]
MASK = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def _ppo_inputs():
    logps = _t([[math.log(r) for r in RATIOS]]).requires_grad_()
    return logps, torch.zeros(1, 6), _t([ADVS]), _t([MASK])


def test_policy_loss_asymmetric_clip_and_fractions():
    logps, old, adv, mask = _ppo_inputs()
    loss, metrics = policy_loss(logps, old, adv, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, _t([[-1.28, 0.8, -2.2, -0.7, 4.0, 0.0]]))
    assert metrics["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 5)
    assert metrics["dual_clip_frac"].item() == 0.0
    # approx_kl = k3 of KL(old || current): ratio - 1 - log(ratio), averaged over masked tokens.
    expected_kl = sum(r - 1 - math.log(r) for r in RATIOS[:5]) / 5
    assert metrics["approx_kl"].item() == pytest.approx(expected_kl, rel=1e-5)
    assert all(not v.requires_grad for v in metrics.values())


def test_policy_loss_dual_clip():
    logps, old, adv, mask = _ppo_inputs()
    loss, metrics = policy_loss(logps, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(loss, _t([[-1.28, 0.8, -2.2, -0.7, 3.0, 0.0]]))
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logps, old, adv, mask, dual_clip=1.0)


def test_policy_loss_truncated_importance_sampling():
    # exp(old - engine) = [0.5, 1, 2, 3, 1, 1], capped at 2 -> weights [0.5, 1, 2, 2, 1, 1].
    logps, old, adv, mask = _ppo_inputs()
    engine = _t([[-math.log(w) for w in [0.5, 1.0, 2.0, 3.0, 1.0, 1.0]]]).requires_grad_()
    torch.testing.assert_close(
        truncated_is_weights(old, engine, 2.0), _t([[0.5, 1.0, 2.0, 2.0, 1.0, 1.0]])
    )
    loss, metrics = policy_loss(logps, old, adv, mask, 0.2, 0.28, engine_logps=engine, tis_coef=2.0)
    torch.testing.assert_close(loss, _t([[-0.64, 0.8, -4.4, -1.4, 4.0, 0.0]]))
    assert metrics["tis_weight"].item() == pytest.approx(6.5 / 5)
    assert "engine_kl" in metrics
    loss.sum().backward()
    assert engine.grad is None  # the weights are detached
    with pytest.raises(ValueError, match="engine_logps"):
        policy_loss(logps, old, adv, mask, tis_coef=2.0)


def test_policy_loss_gradients_follow_mask():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g)
    logps = old.clone().requires_grad_()  # ratio 1: nothing is clipped
    adv = torch.randn(3, 5, generator=g).sign()
    mask = _t([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1]])
    loss, _ = policy_loss(logps, old, adv, mask)
    (loss * mask / mask.sum()).sum().backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A / n_tokens.
    torch.testing.assert_close(logps.grad, -adv * mask / mask.sum())
    assert (logps.grad[mask == 1] != 0).all() and (logps.grad[mask == 0] == 0).all()


# -------------------------------------------------------------------------------------- averaging

# Three samples: sample 0 spans two sequences (labels 0-1 and 2), sample 1 has label 3 only, and
# sample 2 has no trained label (it still counts as a sample).
PER_TOKEN = [1.0, 2.0, 3.0, 4.0, 5.0]
AVG_MASK = [1.0, 1.0, 1.0, 1.0, 0.0]
SAMPLE_OF_LABEL = [0, 0, 0, 1, 2]


@pytest.mark.parametrize(
    "level,constant,expected",
    [
        ("token", None, (1 + 2 + 3 + 4) / 4),
        ("sequence", None, ((1 + 2 + 3) / 3 + 4 / 1 + 0) / 3),
        ("constant", 4, (1 + 2 + 3 + 4) / (4 * 3)),
    ],
)
def test_loss_weights_levels(level, constant, expected):
    weights = loss_weights(_t(AVG_MASK), torch.tensor(SAMPLE_OF_LABEL), 3, level, constant)
    assert (weights * _t(PER_TOKEN)).sum().item() == pytest.approx(expected)
    assert ((weights > 0) == (_t(AVG_MASK) > 0)).all()


@pytest.mark.parametrize("level", AVERAGING_LEVELS)
def test_loss_weights_of_a_batch_split_anyhow_sum_to_its_average(level):
    g = torch.Generator().manual_seed(1)
    per_token = torch.randn(40, generator=g)
    mask = (torch.rand(40, generator=g) > 0.4).float()
    samples = torch.sort(torch.randint(0, 7, (40,), generator=g)).values
    weights = loss_weights(mask, samples, 7, level, constant=4)
    parts = sum((per_token[i : i + 9] * weights[i : i + 9]).sum() for i in range(0, 40, 9))
    # The average computed sample by sample, by hand.
    means = []
    for k in range(7):
        tokens = [float(per_token[i]) for i in range(40) if samples[i] == k and mask[i] > 0]
        means.append(tokens)
    everything = [v for tokens in means for v in tokens]
    expected = {"token": sum(everything) / len(everything),
                "sequence": sum(sum(t) / len(t) for t in means if t) / 7,
                "constant": sum(everything) / (4 * 7)}[level]
    assert parts.item() == pytest.approx(expected, rel=1e-5)


def test_loss_weights_errors():
    with pytest.raises(ValueError, match="constant"):
        loss_weights(_t(AVG_MASK), torch.tensor(SAMPLE_OF_LABEL), 3, "constant")
    with pytest.raises(ValueError, match="choose one of token, sequence, constant"):
        loss_weights(_t(AVG_MASK), torch.tensor(SAMPLE_OF_LABEL), 3, "batch")


# ---------------------------------------------------------------------------- value loss, entropy


def test_value_loss_clipped_and_unclipped():
    # clip 0.2:
    # t0: V 1.0, old 0.5, R 3.0: (1 - 3)^2 = 4; clipped V 0.7: (0.7 - 3)^2 = 5.29 -> 0.5 * 5.29
    # t1: V 2.0, old 2.0, R 1.0: 1 and 1 -> 0.5
    # t2: masked -> 0
    # t3: V 1.0, old 0.5, R 0.0: 1; clipped V 0.7: 0.49 -> max is 1 -> 0.5
    values = _t([[1.0, 2.0, 0.0, 1.0]]).requires_grad_()
    old, returns = _t([[0.5, 2.0, 0.0, 0.5]]), _t([[3.0, 1.0, 0.5, 0.0]])
    mask = _t([[1.0, 1.0, 0.0, 1.0]])
    clipped = value_loss(values, old, returns, mask, clip=0.2)
    torch.testing.assert_close(clipped, _t([[2.645, 0.5, 0.0, 0.5]]))
    torch.testing.assert_close(value_loss(values, old, returns, mask), _t([[2.0, 0.5, 0.0, 0.5]]))
    clipped.sum().backward()
    # t0 took the clipped branch (constant in V); t3 has grad V - R = 1; t2 is masked.
    torch.testing.assert_close(values.grad, _t([[0.0, 1.0, 0.0, 1.0]]))


def test_entropy_matches_direct_sum():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 3, 5, generator=g)
    expected = []
    for row in logits.tolist():
        expected.append([])
        for vec in row:
            z = sum(math.exp(v) for v in vec)
            p = [math.exp(v) / z for v in vec]
            expected[-1].append(-sum(pi * math.log(pi) for pi in p))
    torch.testing.assert_close(entropy_from_logits(logits), _t(expected))


def test_entropy_is_stable_for_extreme_and_masked_logits():
    logits = _t([[0.0, 0.0, float("-inf")], [1000.0, 0.0, -1000.0]]).requires_grad_()
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, _t([math.log(2.0), 0.0]))
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_policy_loss_is_not_weighted_yet():
    # ratio 1, A = [1, 5, -1] -> per-token loss [-1, 0 (weight 0), 1], not yet weighted.
    logps = torch.zeros(1, 3, requires_grad=True)
    weights = _t([[2.0, 0.0, 1.0]])
    loss, _ = policy_loss(logps, torch.zeros(1, 3), _t([[1.0, 5.0, -1.0]]), weights)
    torch.testing.assert_close(loss, _t([[-1.0, 0.0, 1.0]]))
