"""DPO / IPO / conservative DPO, ORPO and Bradley-Terry losses against their formulas."""

import math

import pytest
import torch

from RL2.algs.preference import DPO_LOSSES, bradley_terry_loss, dpo_loss, log1mexp, orpo_loss


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


# Pair 0: policy/ref log-ratios chosen 1, rejected -1 -> h = 2.
# Pair 1: chosen 0, rejected 1 -> h = -1.
CHOSEN, REJECTED = _t([-10.0, -5.0]), _t([-12.0, -4.0])
REF_CHOSEN, REF_REJECTED = _t([-11.0, -5.0]), _t([-11.0, -5.0])
BETA = 0.1


def test_dpo_sigmoid_loss_and_metrics():
    loss, metrics = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=BETA)
    # -log sigmoid(beta * h) = log(1 + exp(-beta * h))
    torch.testing.assert_close(loss, _t([_softplus(-0.2), _softplus(0.1)]))
    torch.testing.assert_close(metrics["rewards_chosen"], _t([0.1, 0.0]))
    torch.testing.assert_close(metrics["rewards_rejected"], _t([-0.1, 0.1]))
    torch.testing.assert_close(metrics["margin"], _t([0.2, -0.1]))
    torch.testing.assert_close(metrics["accuracy"], _t([1.0, 0.0]))


def test_conservative_dpo_label_smoothing():
    loss, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, label_smoothing=0.1)
    # (1 - eps) * -log sigmoid(beta h) + eps * -log sigmoid(-beta h)
    expected = [
        0.9 * _softplus(-0.2) + 0.1 * _softplus(0.2),
        0.9 * _softplus(0.1) + 0.1 * _softplus(-0.1),
    ]
    torch.testing.assert_close(loss, _t(expected))
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, label_smoothing=0.5)


def test_ipo_loss():
    # (h - 1 / (2 beta))^2 with 1 / (2 * 0.1) = 5: (2 - 5)^2 = 9, (-1 - 5)^2 = 36.
    loss, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, loss_type="ipo")
    torch.testing.assert_close(loss, _t([9.0, 36.0]))
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, "ipo", label_smoothing=0.1)


def test_unknown_dpo_loss_type_lists_names():
    assert set(DPO_LOSSES) == {"sigmoid", "ipo"}
    with pytest.raises(ValueError, match="valid.*'ipo'.*'sigmoid'"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, loss_type="hinge")


def test_orpo_loss_and_metrics():
    chosen, rejected = [-0.5, -2.0], [-1.5, -0.25]

    def log_odds(x):
        return x - math.log(1 - math.exp(x))

    diffs = [log_odds(c) - log_odds(r) for c, r in zip(chosen, rejected)]
    loss, metrics = orpo_loss(_t(chosen), _t(rejected), beta=BETA)
    # -beta * log sigmoid(d) = beta * log(1 + exp(-d))
    torch.testing.assert_close(loss, _t([BETA * _softplus(-d) for d in diffs]))
    torch.testing.assert_close(metrics["log_odds"], _t(diffs))
    torch.testing.assert_close(metrics["log_odds_ratio"], _t([-_softplus(-d) for d in diffs]))
    torch.testing.assert_close(metrics["rewards_chosen"], _t([-0.05, -0.2]))
    torch.testing.assert_close(metrics["accuracy"], _t([1.0, 0.0]))


def test_orpo_gradient_stays_finite_when_a_chosen_response_is_certain():
    # A mean logp of exactly 0 (every token certain in float32): infinite odds. The other pair's
    # gradient is the analytic one, d/dc [-beta * logsigmoid(d)] = -beta * sigmoid(-d) / (1 - e^c).
    chosen, rejected = _t([0.0, -0.5]).requires_grad_(), _t([-1.0, -1.0]).requires_grad_()
    loss, _ = orpo_loss(chosen, rejected, beta=BETA)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
    d = (-0.5 - math.log(1 - math.exp(-0.5))) - (-1.0 - math.log(1 - math.exp(-1.0)))
    sigmoid = 1 / (1 + math.exp(d))
    torch.testing.assert_close(chosen.grad[1], _t(-BETA * sigmoid / (1 - math.exp(-0.5))))
    torch.testing.assert_close(rejected.grad[1], _t(BETA * sigmoid / (1 - math.exp(-1.0))))
    assert chosen.grad[0] == 0.0 and loss[0] < BETA * 1e-5  # certain: no push through the odds, ~no loss


def test_log1mexp_is_accurate_at_both_ends():
    x = _t([-1e-10, -0.1, -1.0, -50.0]).requires_grad_()
    out = log1mexp(x)
    # Near 0, 1 - exp(x) ~ -x; far below 0, log(1 - e^x) ~ -e^x.
    expected = [math.log(1e-10), math.log(-math.expm1(-0.1)), math.log1p(-math.exp(-1.0))]
    expected.append(-math.exp(-50.0))
    torch.testing.assert_close(out, _t(expected), rtol=1e-5, atol=0.0)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_bradley_terry_loss():
    loss = bradley_terry_loss(_t([1.0, 0.0]), _t([0.0, 2.0]))
    torch.testing.assert_close(loss, _t([_softplus(-1.0), _softplus(2.0)]))


# ---------------------------------------------------------------------------------- gradient flow


def _token_logps(seed: int):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(4, 6, generator=g) - 0.1).requires_grad_()  # rows: c0, c1, r0, r1
    mask = _t([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0]])
    return logps, mask


def _assert_grads_follow_mask(grad, mask):
    assert (grad[mask == 1] != 0).all()
    assert (grad[mask == 0] == 0).all()


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_gradients_follow_mask(loss_type):
    logps, mask = _token_logps(0)
    seq = (logps * mask).sum(-1)
    if loss_type == "ipo":
        seq = seq / mask.sum(-1)
    ref = seq.detach() - 0.3
    loss, _ = dpo_loss(seq[:2], seq[2:], ref[:2], ref[2:], BETA, loss_type=loss_type)
    loss.mean().backward()
    _assert_grads_follow_mask(logps.grad, mask)


def test_orpo_and_bradley_terry_gradients_follow_mask():
    logps, mask = _token_logps(1)
    avg = (logps * mask).sum(-1) / mask.sum(-1)
    loss, _ = orpo_loss(avg[:2], avg[2:], BETA)
    loss.mean().backward()
    _assert_grads_follow_mask(logps.grad, mask)

    rewards = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()
    seq_rewards = (rewards * mask).sum(-1)
    bradley_terry_loss(seq_rewards[:2], seq_rewards[2:]).mean().backward()
    _assert_grads_follow_mask(rewards.grad, mask)
