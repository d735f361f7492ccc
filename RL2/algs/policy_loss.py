"""Actor and critic losses as pure tensor functions.

Layout convention: token-level tensors are `[..., T]` float tensors (padded rows, or packed labels)
with a `mask` (1.0 on the action tokens that count, 0.0 elsewhere; non-negative token weights also
work); token t's logprob is the logprob of the action token at t. Loss functions return per-token
losses, zeroed where `mask` is 0 but not yet weighted: the caller weights them once with the
averaging weights of `RL2.algs.averaging`.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from RL2.algs.kl import k3


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    # The mask may hold fractional token weights that sum to less than 1 (a micro-batch's share of the
    # global batch): only an all-zero mask must be kept from dividing by zero.
    return (x * mask).sum() / mask.sum().clamp(min=torch.finfo(mask.dtype).tiny)


def truncated_is_weights(old_logps: Tensor, engine_logps: Tensor, tis_coef: float) -> Tensor:
    """Truncated importance weights min(pi_old / pi_engine, tis_coef), detached.

    The rollout engine (e.g. SGLang in bf16 with its own kernels) samples from a slightly different
    distribution than the trainer's policy, which makes "on-policy" training silently off-policy.
    Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"
    (https://fengyao.notion.site/off-policy-rl) correct for it with these truncated weights.

    Args:
        old_logps: `[B, T]` trainer logprobs of the sampled tokens before the update.
        engine_logps: `[B, T]` logprobs the rollout engine reported for the same tokens.
        tis_coef: upper bound of the weight.
    """
    return torch.exp(old_logps - engine_logps).clamp(max=tis_coef).detach()


def policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    engine_logps: Tensor | None = None,
    tis_coef: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), per token.

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),
    with r_t = exp(logp_t - old_logp_t).
    An upper bound `clip_high` above `clip_low` is DAPO's clip-higher (arXiv 2503.14476, sec. 3.1):
    it leaves room to raise the probability of unlikely tokens, which keeps entropy from collapsing.
    With `dual_clip` = c > 1 (Ye et al. 2020, arXiv 1912.09729), tokens with A_t < 0 have their loss
    bounded by -c A_t, so a huge ratio on a bad action cannot blow up the update.

    Args:
        logps: `[B, T]` current logprobs (with grad).
        old_logps: `[B, T]` logprobs of the policy that the advantages were computed for.
        advantages: `[B, T]` token advantages.
        mask: `[B, T]` 1.0 on action tokens, or non-negative token weights (metrics are
            weighted means; the loss is only zeroed where the mask is 0, the caller weights it).
        clip_low: lower clip range, the ratio is clipped at 1 - clip_low.
        clip_high: upper clip range, the ratio is clipped at 1 + clip_high.
        dual_clip: the dual-clip constant c (> 1), or None.
        engine_logps: `[B, T]` rollout-engine logprobs, for truncated importance sampling.
        tis_coef: cap of the truncated importance weight; None disables it.

    Returns:
        `(per_token_loss [B, T], metrics)`. Metrics are detached scalars averaged over the masked
        tokens: `clip_frac_low`, `clip_frac_high`, `dual_clip_frac`, `approx_kl` (k3 estimate of
        KL(old || current)) and, when `engine_logps` is given, `engine_kl` (k3 estimate of
        KL(engine || old)) and, with TIS, `tis_weight`.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (3 is a common choice), got {dual_clip}.")
    if tis_coef is not None and engine_logps is None:
        raise ValueError("tis_coef is set but engine_logps is None: pass the rollout logprobs.")

    ratio = torch.exp(logps - old_logps)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)

    negative = advantages < 0
    dual_clipped = torch.zeros_like(negative)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_clipped = negative & (loss > bound)
        loss = torch.where(negative, torch.minimum(loss, bound), loss)

    metrics = {
        "clip_frac_low": ((ratio < 1.0 - clip_low) & negative).float(),
        "clip_frac_high": ((ratio > 1.0 + clip_high) & (advantages > 0)).float(),
        "dual_clip_frac": dual_clipped.float(),
        "approx_kl": k3(old_logps, logps),
    }
    if engine_logps is not None:
        metrics["engine_kl"] = k3(engine_logps, old_logps)
    if tis_coef is not None:
        weights = truncated_is_weights(old_logps, engine_logps, tis_coef)
        loss = loss * weights
        metrics["tis_weight"] = weights
    metrics = {k: _masked_mean(v.detach(), mask) for k, v in metrics.items()}
    return loss * (mask > 0), metrics


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = None
) -> Tensor:
    """PPO critic loss 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), per token.

    Value clipping as in the PPO reference implementation (OpenAI baselines ppo2): the new value may
    not move more than `clip` from the old one to reduce the loss.

    Args:
        values: `[B, T]` current value predictions (with grad).
        old_values: `[B, T]` values at rollout time.
        returns: `[B, T]` regression targets (e.g. the returns of `gae`).
        mask: `[B, T]` 1.0 on action tokens.
        clip: clip range, or None for a plain squared error.

    Returns:
        `[B, T]` losses, 0 where `mask` is 0.
    """
    loss = (values - returns).pow(2)
    if clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped_values - returns).pow(2))
    return 0.5 * loss * (mask > 0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy -sum_v p_v log p_v of the softmax over the last dimension.

    Computed from `log_softmax`, which never forms exp of a large logit; logits of -inf (masked
    vocabulary entries) contribute 0 instead of 0 * -inf = nan.

    Args:
        logits: `[..., V]` unnormalised logits. Cast to float32 first if they are bf16: the sum
            over a large vocabulary loses precision otherwise.

    Returns:
        `[...]` entropies.
    """
    logp = F.log_softmax(logits, dim=-1)
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * logp).sum(-1)
