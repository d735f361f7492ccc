"""Pairwise preference losses: every input is `[batch]`, one entry per (chosen, rejected) pair, and the
log-probabilities are the response tokens' (summed unless a loss asks for per-token means). Losses and
detached metrics are returned per pair; the caller averages them (over the global batch)."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _sigmoid_dpo(logits: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7); with label_smoothing > 0 conservative DPO (Mitchell
    2023, https://ericmitchell.ai/cdpo.pdf, eq. 3), whose labels are flipped with that probability."""
    return -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)


def _ipo(logits: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """IPO (Azar et al. 2023, arXiv 2310.12036, eq. 17): (h - 1 / (2 tau))^2 with tau = beta, a finite target
    for the margin, so that deterministic preferences are not overfitted."""
    if label_smoothing != 0.0:
        raise ValueError("label_smoothing applies to loss_type='sigmoid'; set it to 0 for ipo.")
    return (logits - 1 / (2 * beta)).pow(2)


DPO_LOSSES: dict[str, Callable[[Tensor, float, float], Tensor]] = {"sigmoid": _sigmoid_dpo, "ipo": _ipo}


def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
             beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO-family loss on h = (logp_c - logp_r) - (ref_logp_c - ref_logp_r), per pair, of summed response logps;
    for loss_type="ipo" of length-normalised ones (each sum over its response tokens, policy and reference
    alike, as TRL's DPOTrainer does), which keeps the target margin 1 / (2 beta) independent of the lengths.
    `beta` is the KL strength (tau in IPO), `label_smoothing` conservative DPO's label-flip probability in [0, 0.5).
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"Unknown DPO loss_type {loss_type!r}; valid: {sorted(DPO_LOSSES)}.")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}.")
    chosen_logratio = chosen_logps - ref_chosen_logps
    rejected_logratio = rejected_logps - ref_rejected_logps
    loss = DPO_LOSSES[loss_type](chosen_logratio - rejected_logratio, beta, label_smoothing)

    rewards_chosen = (beta * chosen_logratio).detach()
    rewards_rejected = (beta * rejected_logratio).detach()
    margin = rewards_chosen - rewards_rejected
    return loss, {"rewards_chosen": rewards_chosen, "rewards_rejected": rewards_rejected, "margin": margin,
                  "accuracy": (margin > 0).float()}


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate for x near 0 and for very negative x (Maechler 2012, "Accurately
    Computing log(1 - exp(-|a|))"): log(-expm1(x)) above -log 2, where 1 - exp(x) cancels, else log1p(-exp(x))."""
    near_zero = x > -0.6931471805599453
    # Evaluate each branch on inputs valid for it so the unused branch cannot produce nan grads.
    safe_near = torch.where(near_zero, x, torch.full_like(x, -1.0))
    safe_far = torch.where(near_zero, torch.full_like(x, -1.0), x)
    near = torch.log(-torch.expm1(safe_near))
    far = torch.log1p(-torch.exp(safe_far))
    return torch.where(near_zero, near, far)


def _log_odds(avg_logps: Tensor) -> Tensor:
    """log(P / (1 - P)) with P = exp(avg_logps). A response whose every token is certain in float32 has a mean
    logp of exactly 0, odds 1 / 0 and a nan gradient that would lose the whole step: held just below 0, its odds
    are finite, and the clamp passes it no gradient through this term (its NLL still has one)."""
    avg_logps = avg_logps.clamp(max=-1e-7)
    return avg_logps - log1mexp(avg_logps)


def orpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """ORPO's odds-ratio term (Hong et al. 2024, arXiv 2403.07691, eqs. 4-7), per pair:
    -beta * logsigmoid(log odds_chosen - log odds_rejected), with odds(y) = P / (1 - P), P = exp(mean per-token
    logp), so log odds = logp - log(1 - exp(logp)). Added to the chosen responses' NLL (the SFT term) it makes
    the ORPO loss; beta is lambda. The inputs are mean per-token logps (< 0); the rewards logged are beta times
    them, as TRL logs them."""
    log_odds = _log_odds(chosen_avg_logps) - _log_odds(rejected_avg_logps)
    log_odds_ratio = F.logsigmoid(log_odds)
    return -beta * log_odds_ratio, {
        "log_odds": log_odds.detach(), "log_odds_ratio": log_odds_ratio.detach(),
        "rewards_chosen": (beta * chosen_avg_logps).detach(), "rewards_rejected": (beta * rejected_avg_logps).detach(),
        "accuracy": (chosen_avg_logps > rejected_avg_logps).float()}


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """Reward-model loss -log sigmoid(r_c - r_r) (Bradley & Terry 1952; Ouyang et al. 2022)."""
    return -F.logsigmoid(chosen_rewards - rejected_rewards)
