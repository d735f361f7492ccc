"""KL estimators, the PPO, GSPO and CISPO policy losses, their engine corrections (truncation, IcePop,
trajectory masks) and the engine KL split by lag, the value loss, loss averaging and entropy on
hand-made tensors."""

import math

import pytest
import torch

from RL2.algs.averaging import AVERAGING_LEVELS, loss_weights
from RL2.algs.kl import KL_ESTIMATORS, compute_kl, k1, k2, k3
from RL2.algs.policy_loss import (
    Correction,
    cispo_loss,
    engine_kl_by_lag,
    gspo_loss,
    lag_means,
    ppo_loss,
    truncated_is_weights,
)
from RL2.algs.value_loss import value_loss
from RL2.models.chunked_logps import entropy


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
    loss, metrics = ppo_loss(logps, old, adv, mask, clip_low=0.2, clip_high=0.28)
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
    loss, metrics = ppo_loss(logps, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(loss, _t([[-1.28, 0.8, -2.2, -0.7, 3.0, 0.0]]))
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_loss(logps, old, adv, mask, dual_clip=1.0)


def test_policy_loss_truncated_importance_sampling():
    # exp(old - engine) = [0.5, 1, 2, 3, 1, 1], capped at 2 -> weights [0.5, 1, 2, 2, 1, 1].
    logps, old, adv, mask = _ppo_inputs()
    engine = _t([[-math.log(w) for w in [0.5, 1.0, 2.0, 3.0, 1.0, 1.0]]]).requires_grad_()
    torch.testing.assert_close(
        truncated_is_weights(old, engine, 2.0), _t([[0.5, 1.0, 2.0, 2.0, 1.0, 1.0]])
    )
    loss, metrics = ppo_loss(logps, old, adv, mask, 0.2, 0.28, engine_logps=engine, tis_coef=2.0)
    torch.testing.assert_close(loss, _t([[-0.64, 0.8, -4.4, -1.4, 4.0, 0.0]]))
    assert metrics["tis_weight"].item() == pytest.approx(6.5 / 5)
    assert "engine_kl" in metrics
    loss.sum().backward()
    assert engine.grad is None  # the weights are detached
    with pytest.raises(ValueError, match="engine_logps"):
        ppo_loss(logps, old, adv, mask, tis_coef=2.0)


def test_policy_loss_gradients_follow_mask():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g)
    logps = old.clone().requires_grad_()  # ratio 1: nothing is clipped
    adv = torch.randn(3, 5, generator=g).sign()
    mask = _t([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1]])
    loss, _ = ppo_loss(logps, old, adv, mask)
    (loss * mask / mask.sum()).sum().backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A / n_tokens.
    torch.testing.assert_close(logps.grad, -adv * mask / mask.sum())
    assert (logps.grad[mask == 1] != 0).all() and (logps.grad[mask == 0] == 0).all()


# ------------------------------------------------------------------------------ engine corrections


@pytest.mark.parametrize("loss_fn", ["ppo", "gspo", "cispo"])
def test_tis_coef_is_the_tis_correction_and_todays_truncation_bit_for_bit(loss_fn):
    """actor.tis_coef=C, actor.correction.type=tis with high=C and the loss times min(rho, C) (what the
    losses computed before corrections had names) give the same bits, loss and gradient."""
    old = _t([[-1.0, -2.0, -0.5, -3.0, -1.2, -0.7]])
    engine = old - _t([[math.log(w) for w in [0.5, 1.0, 2.0, 3.0, 1.7, 1.0]]])
    adv, mask, samples = _t([ADVS]), _t([MASK]), torch.tensor([[0, 0, 0, 1, 1, 1]])

    def run(**correction):
        logps = (old + _t([[0.1, -0.2, 0.05, 0.3, -0.1, 0.0]])).requires_grad_()
        if loss_fn == "gspo":
            loss, metrics = gspo_loss(logps, old, adv, mask, samples, 0.2, 0.2, **correction)
        else:
            loss, metrics = (ppo_loss if loss_fn == "ppo" else cispo_loss)(logps, old, adv, mask, **correction)
        loss.sum().backward()
        return loss.detach(), logps.grad, metrics

    short = run(engine_logps=engine, tis_coef=2.0)
    by_name = run(engine_logps=engine, correction=Correction("tis", high=2.0))
    plain_loss, _, _ = run()
    assert torch.equal(short[0], by_name[0]) and torch.equal(short[1], by_name[1])
    assert torch.equal(short[0], plain_loss * truncated_is_weights(old, engine, 2.0))
    # rho = [0.5, 1, 2, 3, 1.7] on the trained tokens: truncated at 2 -> [0.5, 1, 2, 2, 1.7].
    assert short[2]["tis_weight"].item() == pytest.approx(7.2 / 5)
    assert short[2]["correction_weight"].item() == pytest.approx(7.2 / 5)
    assert short[2]["correction_weight_min"].item() == pytest.approx(0.5)
    assert short[2]["correction_weight_max"].item() == pytest.approx(2.0)
    assert short[2]["correction_frac"].item() == pytest.approx(1 / 5)  # only rho = 3 was truncated
    with pytest.raises(ValueError, match="not both"):
        ppo_loss(*_ppo_inputs(), engine_logps=engine, tis_coef=2.0, correction=Correction("tis"))


def test_icepop_masks_tokens_outside_its_band_and_weighs_the_others_by_rho():
    # rho = exp(old - engine) = [0.4, 1, 2, 6, 5, 9 (not trained)], band [0.5, 5]: tokens 0 and 3 masked.
    logps, old, adv, mask = _ppo_inputs()
    engine = old - _t([[math.log(r) for r in [0.4, 1.0, 2.0, 6.0, 5.0, 9.0]]])
    plain, _ = ppo_loss(logps, old, adv, mask, 0.2, 0.28)
    loss, metrics = ppo_loss(logps, old, adv, mask, 0.2, 0.28, engine_logps=engine,
                             correction=Correction("icepop", low=0.5, high=5.0))
    weights = _t([[0.0, 1.0, 2.0, 0.0, 5.0, 0.0]])
    torch.testing.assert_close(loss, plain.detach() * weights)
    loss.sum().backward()
    assert logps.grad[0, 0] == 0 and logps.grad[0, 3] == 0 and logps.grad[0, 2] != 0
    assert metrics["correction_frac"].item() == pytest.approx(2 / 5)
    assert metrics["correction_weight"].item() == pytest.approx(8 / 5)
    assert metrics["correction_weight_min"].item() == 0.0
    assert metrics["correction_weight_max"].item() == pytest.approx(5.0)
    assert "tis_weight" not in metrics
    assert Correction("icepop").bounds == (0.5, 5.0)  # IcePop's published band


# Three trajectories in one row, the first token a prompt whose huge log-ratio must not count:
#   sample     0    0    0     1     1    2 (x8)
#   mask       0    1    1     1     1    1
#   log rho    9   0.5  0.3  -0.2   0.1   0.09
# products:  e^0.8 = 2.23,  e^-0.1 = 0.905,  e^0.72 = 2.05
# geometric: e^0.4 = 1.49,  e^-0.05 = 0.951, e^0.09 = 1.094
MASK_SAMPLES = [[0, 0, 0, 1, 1] + [2] * 8]
MASK_MASK = [[0.0] + [1.0] * 12]
MASK_LOG_RHO = [[9.0, 0.5, 0.3, -0.2, 0.1] + [0.09] * 8]


@pytest.mark.parametrize("name,high,kept,masked_share", [
    ("seq_mask", 2.0, [1], 10 / 12),  # the long trajectory's product passes 2: masked with the first
    ("geo_mask", 1.1, [1, 2], 2 / 12),  # its geometric mean stays under 1.1: only the first is masked
])
def test_trajectory_masks_keep_or_drop_whole_trajectories(name, high, kept, masked_share):
    old = torch.full((1, 13), -1.0)
    logps = old.clone().requires_grad_()  # ratio 1: the plain loss is -A = -1 on every trained token
    engine, samples, mask = old - _t(MASK_LOG_RHO), torch.tensor(MASK_SAMPLES), _t(MASK_MASK)
    loss, metrics = ppo_loss(logps, old, torch.ones(1, 13), mask, engine_logps=engine,
                             correction=Correction(name, high=high), sample_ids=samples)
    weights = torch.isin(samples, torch.tensor(kept)).float() * mask
    torch.testing.assert_close(loss, -weights)
    assert metrics["correction_frac"].item() == pytest.approx(masked_share)
    assert (metrics["correction_weight_min"].item(), metrics["correction_weight_max"].item()) == (0.0, 1.0)
    low, _ = Correction(name, high=high).bounds
    assert low == pytest.approx(1 / high)  # the band is symmetric in log space unless low is set
    with pytest.raises(ValueError, match="sample_ids"):
        ppo_loss(logps, old, torch.ones(1, 13), mask, engine_logps=engine, correction=Correction(name))


def test_engine_kl_splits_into_the_current_weights_tokens_and_older_ones():
    """Summed over two micro-batches, then divided: the weighted mean of k3 over each lag class."""
    old = _t([[-1.0, -2.0, -1.0, -3.0, -0.5]])
    gaps = [0.1, 0.2, -0.1, 0.3, 0.7]  # engine - old
    engine = old + _t([gaps])
    lags, weights = torch.tensor([[0, 1, 0, 2, 0]]), _t([[0.25, 0.25, 0.25, 0.25, 0.0]])  # the last not trained
    k = [math.exp(-d) - 1 + d for d in gaps]  # k3 of KL(engine || old) per token
    halves = [engine_kl_by_lag(old[:, part], engine[:, part], lags[:, part], weights[:, part])
              for part in (slice(0, 2), slice(2, 5))]
    summed = {name: float(halves[0][name] + halves[1][name]) for name in halves[0]}
    means = lag_means({f"actor/{name}": value for name, value in summed.items()} | {"actor/loss": 1.0}, "actor/")
    assert means["actor/engine_kl_lag0"] == pytest.approx((k[0] + k[2]) / 2)
    assert means["actor/engine_kl_lagged"] == pytest.approx((k[1] + k[3]) / 2)
    assert set(means) == {"actor/engine_kl_lag0", "actor/engine_kl_lagged", "actor/loss"}
    fresh = engine_kl_by_lag(old, engine, torch.zeros_like(lags), weights)  # a synchronous step
    assert "engine_kl_lagged" not in lag_means({name: float(v) for name, v in fresh.items()})


# ------------------------------------------------------------------------------------------- GSPO

# One packed row holding two trajectories. Trajectory 0 spans two sequences: prompt, 2 sampled tokens,
# then a new sequence's prompt token and 1 sampled token; trajectory 1 is one sequence. The prompt
# tokens carry a large log-ratio that must not count.
#   token      0    1     2     3    4     5    6      7
#   sample     0    0     0     0    0     1    1      1
#   mask       0    1     1     0    1     0    1      1
#   log r     5.0  0.3  -0.1   5.0  0.1   5.0  0.02  -0.02
# s_0 = exp((0.3 - 0.1 + 0.1) / 3) = exp(0.1); s_1 = exp(0) = 1.
GSPO_SAMPLES = [[0, 0, 0, 0, 0, 1, 1, 1]]
GSPO_MASK = [[0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]]
GSPO_LOG_RATIOS = [[5.0, 0.3, -0.1, 5.0, 0.1, 5.0, 0.02, -0.02]]
S0 = math.exp(0.1)


def _gspo_inputs(advantages):
    old = -torch.arange(1.0, 9.0).unsqueeze(0) / 4
    logps = (old + _t(GSPO_LOG_RATIOS)).requires_grad_()
    return logps, old, _t([advantages]), _t(GSPO_MASK), torch.tensor(GSPO_SAMPLES)


def _sequence_average_weights():
    """GSPO's average: each trajectory counts 1/2, each of its sampled tokens 1/|y_i| of that."""
    return _t([[0, 1 / 6, 1 / 6, 0, 1 / 6, 0, 1 / 4, 1 / 4]])


@pytest.mark.parametrize("token_level", [False, True])
def test_gspo_ratio_spans_a_trajectory_of_two_sequences(token_level):
    # Clip range 0.2: nothing clipped. A = +1 on trajectory 0, -1 on trajectory 1.
    logps, old, adv, mask, samples = _gspo_inputs([1.0] * 5 + [-1.0] * 3)
    loss, metrics = gspo_loss(logps, old, adv, mask, samples, clip_low=0.2, clip_high=0.2, token_level=token_level)
    torch.testing.assert_close(loss, _t([[0, -S0, -S0, 0, -S0, 0, 1.0, 1.0]]))
    (loss * _sequence_average_weights()).sum().backward()
    # Objective (1/2) [(1/3) sum_t -s_0 + (1/2) sum_t s_1], and d s_i / d logp_u = s_i / |y_i|:
    # trajectory 0's tokens get -(1/2) s_0 / 3, trajectory 1's +(1/2) s_1 / 2; prompt tokens nothing.
    expected_grad = _t([[0, -S0 / 6, -S0 / 6, 0, -S0 / 6, 0, 1 / 4, 1 / 4]])
    torch.testing.assert_close(logps.grad, expected_grad)
    assert metrics["seq_ratio"].item() == pytest.approx((3 * S0 + 2) / 5)
    assert metrics["clip_frac_low"].item() == 0.0 and metrics["clip_frac_high"].item() == 0.0


def test_gspo_clips_whole_trajectories_with_its_own_ranges():
    # s_0 = 1.105 is above 1 + 0.05 with A > 0: trajectory 0 is clipped, every one of its tokens loses its
    # gradient. s_1 = exp(-0.3) = 0.741 is below 1 - 0.2 with A < 0: clipped low.
    logps, old, adv, mask, samples = _gspo_inputs([1.0] * 5 + [-1.0] * 3)
    with torch.no_grad():
        logps[0, 6:] -= 0.3
    loss, metrics = gspo_loss(logps, old, adv, mask, samples, clip_low=0.2, clip_high=0.05)
    torch.testing.assert_close(loss, _t([[0, -1.05, -1.05, 0, -1.05, 0, 0.8, 0.8]]))
    assert metrics["clip_frac_high"].item() == pytest.approx(3 / 5)
    assert metrics["clip_frac_low"].item() == pytest.approx(2 / 5)
    loss.sum().backward()
    assert (logps.grad == 0).all()


def test_gspo_token_keeps_each_tokens_advantage():
    # Advantages that differ within trajectory 0: [2, 1, 0.5]. GSPO spreads their mean over every
    # token's gradient; GSPO-token gives token t A_t s_0 (times its weight 1/6). Values are the same.
    advantages = [0.0, 2.0, 1.0, 0.0, 0.5, 0.0, -1.0, -1.0]
    weights = _sequence_average_weights()
    grads = {}
    for token_level in (False, True):
        logps, old, adv, mask, samples = _gspo_inputs(advantages)
        loss, _ = gspo_loss(logps, old, adv, mask, samples, clip_low=0.2, clip_high=0.2, token_level=token_level)
        torch.testing.assert_close(loss, _t([[0, -2 * S0, -S0, 0, -0.5 * S0, 0, 1.0, 1.0]]))
        (loss * weights).sum().backward()
        grads[token_level] = logps.grad[0, [1, 2, 4]]
    mean_term = -(2.0 + 1.0 + 0.5) * S0 / 6 / 3  # sum_t w_t (-A_t) s_0 / |y_0|, the same on each token
    torch.testing.assert_close(grads[False], _t([mean_term] * 3))
    torch.testing.assert_close(grads[True], _t([-2.0 * S0 / 6, -S0 / 6, -0.5 * S0 / 6]))


def test_gspo_on_policy_ratio_is_one_and_tis_applies():
    logps, _, adv, mask, samples = _gspo_inputs([1.0] * 5 + [-1.0] * 3)
    engine = logps.detach() + math.log(0.5)  # exp(old - engine) = 2, capped at 1.5
    loss, metrics = gspo_loss(logps, logps.detach(), adv, mask, samples, engine_logps=engine, tis_coef=1.5)
    torch.testing.assert_close(loss, -1.5 * adv * mask)
    assert metrics["seq_ratio"].item() == pytest.approx(1.0) and metrics["tis_weight"].item() == pytest.approx(1.5)


# ------------------------------------------------------------------------------------------ CISPO

# ratio r = exp(logp - old) = [1.5, 0.5, 5.0, 1.0, 9.0 (masked)], A = [1, -1, 1, -1, 1].
CISPO_RATIOS = [1.5, 0.5, 5.0, 1.0, 9.0]
CISPO_ADVS = [1.0, -1.0, 1.0, -1.0, 1.0]
CISPO_MASK = [1.0, 1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("clip_low,weights", [(None, [1.5, 0.5, 4.0, 1.0]), (0.2, [1.5, 0.8, 4.0, 1.0])])
def test_cispo_clips_a_detached_weight_and_keeps_every_gradient(clip_low, weights):
    old = _t([[-1.0, -2.0, -3.0, -0.5, -1.0]])
    logps = (old + _t([[math.log(r) for r in CISPO_RATIOS]])).requires_grad_()
    adv, mask = _t([CISPO_ADVS]), _t([CISPO_MASK])
    loss, metrics = cispo_loss(logps, old, adv, mask, clip_low=clip_low, clip_high=3.0)
    # loss_t = -w_t A_t logp_t with w = clip(r, 1 - clip_low, 1 + 3); the masked token is 0.
    logp = logps.detach()[0].tolist()
    expected = [-w * a * lp for w, a, lp in zip(weights, CISPO_ADVS, logp)] + [0.0]
    torch.testing.assert_close(loss, _t([expected]))
    loss.sum().backward()
    # The weight is a constant: d loss_t / d logp_t = -w_t A_t, also where the weight was clipped
    # (token 2's ratio 5 would have no gradient under PPO's clip).
    torch.testing.assert_close(logps.grad, _t([[-w * a for w, a in zip(weights, CISPO_ADVS)] + [0.0]]))
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 4)
    assert metrics["clip_frac_low"].item() == pytest.approx(0.0 if clip_low is None else 1 / 4)
    assert metrics["is_weight"].item() == pytest.approx(sum(weights) / 4)


def test_cispo_truncated_importance_sampling_multiplies_the_loss():
    old = _t([[-1.0, -2.0]])
    logps = old.clone().requires_grad_()
    engine = old + _t([[math.log(0.5), math.log(4.0)]])  # exp(old - engine) = [2, 0.25], capped at 1.5
    loss, metrics = cispo_loss(logps, old, _t([[1.0, 1.0]]), _t([[1.0, 1.0]]), engine_logps=engine, tis_coef=1.5)
    torch.testing.assert_close(loss, _t([[1.5 * 1.0, 0.25 * 2.0]]))
    assert "engine_kl" in metrics


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
    torch.testing.assert_close(entropy(logits), _t(expected))


def test_entropy_is_stable_for_extreme_and_masked_logits():
    logits = _t([[0.0, 0.0, float("-inf")], [1000.0, 0.0, -1000.0]]).requires_grad_()
    ent = entropy(logits)
    torch.testing.assert_close(ent, _t([math.log(2.0), 0.0]))
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_policy_loss_is_not_weighted_yet():
    # ratio 1, A = [1, 5, -1] -> per-token loss [-1, 0 (weight 0), 1], not yet weighted.
    logps = torch.zeros(1, 3, requires_grad=True)
    weights = _t([[2.0, 0.0, 1.0]])
    loss, _ = ppo_loss(logps, torch.zeros(1, 3), _t([[1.0, 5.0, -1.0]]), weights)
    torch.testing.assert_close(loss, _t([[-1.0, 0.0, 1.0]]))
