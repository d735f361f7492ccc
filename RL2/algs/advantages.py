"""Advantage estimators as pure tensor functions (`adv.estimator` names them in `RL2.trainer.ppo_advantages`).

Layout convention (shared by every module in `RL2.algs`): token-level tensors are padded `[batch, seq_len]`
floats with a `mask` that is 1.0 on the action tokens that count (0.0 on prompt, padding and a multi-turn
dialogue's environment tokens), token t's logprob/value/reward that of the action at t; trajectory-level
tensors (a verifier score) are `[batch]`; GRPO-like estimators take each prompt's scores as one row, `[G, n]`."""

import torch
from torch import Tensor

# Standard deviations of group scores follow GRPO as implemented in TRL's GRPOTrainer and in
# upstream RL2 (`torch.std`, i.e. Bessel-corrected, unbiased=True), with this epsilon added.
GROUP_STD_EPS = 1e-6


def masked_discounted_cumsum(x: Tensor, mask: Tensor, discount: float) -> Tensor:
    """Right-to-left discounted sum over the masked tokens of each row: out_t = x_t + discount * out_{t'}, t'
    the next position with mask 1. Tokens with mask 0 neither contribute nor cost a discount step."""
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[:, 0])
    for t in reversed(range(x.shape[1])):
        m = mask[:, t]
        running = torch.where(m > 0, x[:, t] + discount * running, running)
        out[:, t] = running * m
    return out


def deviations(x: Tensor, counted: Tensor | None = None) -> Tensor:
    """x - mean(x) along the last dim, over the `counted` entries (1.0; default all), 0 at the others;
    exactly 0 along a row whose counted values are all equal: in floating point their mean need not equal
    them (eight float32 0.7s average one ulp above 0.7), and a spread of the same size would turn that error
    into a large advantage, so every value is first measured from the row's first counted one (x - mean is
    shift-invariant)."""
    counted, n = _counted(x, counted)
    shifted = (x - _first_counted(x, counted)) * counted
    return (shifted - shifted.sum(-1, keepdim=True) / n.clamp(min=1.0)) * counted


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole tensor, with the population variance
    as OpenRLHF does for REINFORCE++; 0 where `mask` is 0, and exactly 0 where every entry is equal."""
    count = mask.sum().clamp(min=1.0)
    # Measured from one masked entry (argmax finds the first 1.0) so that equal entries give exact zeros.
    shifted = x - x.flatten()[mask.flatten().argmax()]
    centered = shifted - (shifted * mask).sum() / count
    var = (centered.pow(2) * mask).sum() / count
    return centered / (var.sqrt() + eps) * mask


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lamda: float) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv 1506.02438).

    delta_t = r_t + gamma * V_{t'} - V_t and A_t = delta_t + gamma * lamda * A_{t'}, where t' is the next
    action token of the same row (V = 0 after the last one): tokens with mask 0 (a multi-turn dialogue's
    environment tokens) are not steps of the MDP, so neither their rewards nor their values are used; put
    rewards on action tokens. Returns (advantages, returns), 0 where `mask` is 0.
    """
    next_values = torch.zeros_like(values)  # V_{t'} of each action token
    upcoming = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_values[:, t] = upcoming * mask[:, t]
        upcoming = torch.where(mask[:, t] > 0, values[:, t], upcoming)
    deltas = rewards + gamma * next_values - values
    advantages = masked_discounted_cumsum(deltas, mask, gamma * lamda)
    returns = (advantages + values) * mask
    return advantages, returns


def grpo(scores: Tensor, norm_var: bool, counted: Tensor | None = None) -> Tensor:
    """Group-relative advantages of GRPO (arXiv 2402.03300) and Dr. GRPO (arXiv 2503.20783).

    A_i = s_i - mean of its group. With `norm_var` (DeepSeek's GRPO) A_i is divided by the group's
    unbiased std + 1e-6; Dr. GRPO turns it off because it up-weights groups that are almost all right
    or all wrong. A group whose scores are all equal (one sample, or every sample alike) gets exactly 0.
    `counted` (`[G, n]`, 1.0 or 0.0; default all): the samples the group's mean and std are over (a faulted
    trajectory is not); the others get 0.
    """
    counted, n = _counted(scores, counted)
    advantages = deviations(scores, counted)
    if norm_var:
        # The std from the same deviations: 0 for an all-equal group, whose advantages are 0 / eps = 0.
        std = (advantages.pow(2).sum(-1, keepdim=True) / (n - 1).clamp(min=1.0)).sqrt()
        advantages = advantages / (std + GROUP_STD_EPS)
    return advantages


def rloo(scores: Tensor, counted: Tensor | None = None) -> Tensor:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv 2402.14740): the baseline of sample i is the
    mean score of the other counted samples of its group (as in `grpo`, the others get 0); an all-equal
    group gets exactly 0."""
    counted, n = _counted(scores, counted)
    # The baseline is shift-invariant: measured from the group's first score, equal scores give exact zeros.
    scores = (scores - _first_counted(scores, counted)) * counted
    advantages = scores - (scores.sum(-1, keepdim=True) - scores) / (n - 1).clamp(min=1.0)
    return advantages * counted * (n > 1)


def _counted(scores: Tensor, counted: Tensor | None) -> tuple[Tensor, Tensor]:
    """The 0/1 mask of counted samples (all of them by default) and each row's number of them, `[G, 1]`."""
    counted = torch.ones_like(scores) if counted is None else counted.to(scores.dtype)
    return counted, counted.sum(-1, keepdim=True)


def _first_counted(x: Tensor, counted: Tensor) -> Tensor:
    """`[G, 1]`: each row's first counted value."""
    return x.gather(-1, counted.argmax(-1, keepdim=True))


def reinforce_plus_plus(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): token return-to-go, whitened over the batch.

    G_t = sum_{k >= 0} gamma^k r_{t_k}, over the action tokens t = t_0 < t_1 < ... of the row
    (tokens with mask 0 are skipped, as in `gae`), then normalised with the mean and std of G over
    all masked tokens of the batch (no critic, no per-prompt baseline).
    """
    return masked_whiten(masked_discounted_cumsum(rewards, mask, gamma), mask)


def mc(turn_rewards: Tensor, turn_mask: Tensor, gamma: float = 1.0, truncation: int | None = None) -> Tensor:
    """Monte-Carlo returns per turn of a multi-turn trajectory (VinePPO style, arXiv 2410.01679).

    R_k = sum_{j=0}^{h-1} gamma^j r_{k+j}, over the valid turns k, k+1, ... of the row (turns with
    mask 0 are skipped), where h is `truncation` (the number of turns summed, no bootstrap) or
    unbounded. Every action token of turn k then gets R_k. `turn_rewards` and `turn_mask` are `[B, K]`.
    """
    if truncation is not None and truncation < 1:
        raise ValueError(f"truncation must be a positive number of turns or None, got {truncation}")
    # Position of each turn among the row's valid turns; weights[b, k, j] = gamma^(p_j - p_k) for
    # valid turns j at or after k within the truncation window. K is small, so K x K is cheap.
    pos = turn_mask.cumsum(-1) - 1
    steps = pos[:, None, :] - pos[:, :, None]
    valid = (turn_mask[:, None, :] > 0) & (turn_mask[:, :, None] > 0) & (steps >= 0)
    if truncation is not None:
        valid &= steps < truncation
    weights = gamma ** steps.clamp(min=0).to(turn_rewards.dtype) * valid
    return torch.einsum("bkj,bj->bk", weights, turn_rewards)
