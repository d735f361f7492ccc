"""Policy losses as pure tensor functions in the layout of `RL2.algs.advantages` (`mask` may also hold token
weights), returning per-token losses zeroed off the mask, which the caller weights once (`RL2.algs.averaging`).
`ppo_loss`, `gspo_loss` and `cispo_loss` (`actor.policy_loss`, docs/rl.md) take the same engine correction
(`actor.correction`, docs/async.md): a detached per-token multiplier made of rho = pi_old / mu, the trainer's
probability before the update (the proximal policy of decoupled PPO, Hilton et al. 2021, arXiv 2110.00641)
over that of the engine that sampled the token (`CORRECTIONS`)."""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from RL2.algs.kl import k3
from RL2.config.ppo_schema import correction_bounds


def truncated_is_weights(old_logps: Tensor, engine_logps: Tensor, tis_coef: float) -> Tensor:
    """Truncated importance weights min(pi_old / pi_engine, tis_coef), detached (Yao et al. 2025,
    https://fengyao.notion.site/off-policy-rl)."""
    return torch.exp(old_logps - engine_logps).clamp(max=tis_coef).detach()


def _tis(old_logps, engine_logps, mask, sample_ids, low, high):
    weights = truncated_is_weights(old_logps, engine_logps, high)
    return weights, (old_logps - engine_logps).detach() > math.log(high)


def icepop_weights(old_logps: Tensor, engine_logps: Tensor, mask: Tensor, sample_ids: Tensor | None, low: float,
                   high: float) -> tuple[Tensor, Tensor]:
    """IcePop's masked importance weights (Ling Team, Ring-1T, arXiv 2510.18855): rho = pi_old / pi_engine where
    it is in [low, high], else 0, so that tokens whose probabilities the two disagree on are masked, not truncated."""
    ratio = torch.exp(old_logps - engine_logps).detach()
    kept = (ratio >= low) & (ratio <= high)
    return torch.where(kept, ratio, 0.0), ~kept


def trajectory_mask_weights(old_logps: Tensor, engine_logps: Tensor, mask: Tensor, sample_ids: Tensor, low: float,
                            high: float, geometric: bool = False) -> tuple[Tensor, Tensor]:
    """1 on every token of a trajectory whose ratio (the product of its tokens' rho, or with `geometric` their
    geometric mean) is in [low, high], else 0 (verl's sequence-level and geometric rejection sampling); compared
    in log space, where a long product cannot overflow."""
    log_ratio = (old_logps - engine_logps).detach()
    per_trajectory = per_sample(log_ratio, mask, sample_ids, mean=geometric)
    kept = (per_trajectory >= math.log(low)) & (per_trajectory <= math.log(high))
    return kept.to(old_logps.dtype), ~kept


# actor.correction.type -> (old_logps, engine_logps, mask, sample_ids, low, high) -> (weights, tokens
# truncated or masked); the names and their default bounds are RL2/config/ppo_schema.py's CORRECTION_BOUNDS.
CORRECTIONS = {
    "tis": _tis,
    "icepop": icepop_weights,
    "seq_mask": trajectory_mask_weights,
    "geo_mask": lambda *args: trajectory_mask_weights(*args, geometric=True),
}
# Corrections that read a whole trajectory at once (like GSPO's ratio).
TRAJECTORY_LEVEL_CORRECTIONS = ("seq_mask", "geo_mask")


@dataclass(frozen=True)
class Correction:
    """An engine correction of the policy loss (`name`: a key of `CORRECTIONS`) with the bounds of rho (`tis`
    reads `high` only); None: the config's defaults (`correction_bounds`)."""

    name: str
    low: float | None = None
    high: float | None = None

    @property
    def bounds(self) -> tuple[float, float]:
        return correction_bounds(self.name, self.low, self.high)

    def weights(self, old_logps: Tensor, engine_logps: Tensor, mask: Tensor,
                sample_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """(`[B, T]` detached weights, `[B, T]` bool: the tokens truncated or masked)."""
        if self.name in TRAJECTORY_LEVEL_CORRECTIONS and sample_ids is None:
            raise ValueError(f"the {self.name} correction masks whole trajectories: pass sample_ids")
        return CORRECTIONS[self.name](old_logps, engine_logps, mask, sample_ids, *self.bounds)


def _finish_policy_loss(loss: Tensor, metrics: dict[str, Tensor], old_logps: Tensor, engine_logps: Tensor | None,
                        tis_coef: float | None, correction: Correction | None, mask: Tensor,
                        sample_ids: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Every policy loss's last step: log KL(engine || old), apply the engine correction, if any
    (`tis_coef` is `Correction("tis", high=tis_coef)`), zero the loss off the mask and reduce the metrics."""
    if tis_coef is not None:
        if correction is not None:
            raise ValueError("give tis_coef or correction, not both: tis_coef is the correction tis")
        correction = Correction("tis", high=tis_coef)
    if correction is not None and engine_logps is None:
        raise ValueError(f"the {correction.name} correction is set but engine_logps is None: pass the rollout "
                         f"logprobs.")
    if engine_logps is not None:
        metrics["engine_kl"] = k3(engine_logps, old_logps)
    if correction is not None:
        weights, corrected = correction.weights(old_logps, engine_logps, mask, sample_ids)
        if correction.name == "tis":
            metrics["tis_weight"] = weights
        metrics |= {"correction_weight": weights, "correction_weight_min": weights,
                    "correction_weight_max": weights, "correction_frac": corrected.float()}
        loss = loss * weights
    return loss * (mask > 0), _reduce(metrics, mask)


def _reduce(metrics: dict[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
    """Per-token metrics -> detached scalars over the masked tokens: the min or max for names ending so
    (+inf or -inf without a masked token), else the weighted mean."""
    counted = mask > 0
    reduced = {}
    for name, values in metrics.items():
        values = values.detach()
        if name.endswith("_min"):
            reduced[name] = torch.where(counted, values, torch.inf).amin()
        elif name.endswith("_max"):
            reduced[name] = torch.where(counted, values, -torch.inf).amax()
        else:
            # The mask may hold fractional token weights that sum to less than 1 (a micro-batch's share of the
            # global batch): only an all-zero mask must be kept from dividing by zero.
            reduced[name] = (values * mask).sum() / mask.sum().clamp(min=torch.finfo(mask.dtype).tiny)
    return reduced


def engine_kl_by_lag(old_logps: Tensor, engine_logps: Tensor, lags: Tensor, weights: Tensor) -> dict[str, Tensor]:
    """The engine-vs-trainer KL (k3 of KL(engine || old)) of the tokens sampled by the weights being
    trained (`lag0`: the engine's kernels and precision alone) and of those sampled by older weights
    (`lagged`: that plus the policy's drift since), as weighted sums that `lag_means` turns into means
    once added up over micro-batches and ranks. `lags`: how many versions behind each token was sampled."""
    kl, lag0 = k3(engine_logps, old_logps).detach(), lags == 0
    sums = {}
    for part, tokens in (("lag0", lag0), ("lagged", ~lag0)):
        token_weights = weights * tokens
        sums[f"engine_kl_{part}"] = (kl * token_weights).sum()
        sums[f"weight_{part}"] = token_weights.sum()
    return sums


def lag_means(metrics: dict[str, float], prefix: str = "") -> dict[str, float]:
    """`engine_kl_by_lag`'s sums (under `prefix`) -> `engine_kl_lag0` and `engine_kl_lagged` means; a part
    without tokens (a synchronous run has no lagged ones) is left out."""
    metrics = dict(metrics)
    for part in ("lag0", "lagged"):
        weight = metrics.pop(f"{prefix}weight_{part}", None)
        kl = metrics.pop(f"{prefix}engine_kl_{part}", None)
        if weight:
            metrics[f"{prefix}engine_kl_{part}"] = kl / weight
    return metrics


def ppo_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 0.2,
             clip_high: float = 0.2, dual_clip: float | None = None, engine_logps: Tensor | None = None,
             tis_coef: float | None = None, correction: Correction | None = None,
             sample_ids: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), per token.

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), with r_t = exp(logp_t - old_logp_t).
    `clip_high` above `clip_low` is DAPO's clip-higher (arXiv 2503.14476, sec. 3.1), which keeps entropy from
    collapsing. With `dual_clip` = c > 1 (Ye et al. 2020, arXiv 1912.09729), tokens with A_t < 0 have their
    loss bounded by -c A_t, so a huge ratio on a bad action cannot blow up the update.

    `old_logps` are the trainer's for the policy the advantages were computed for; `sample_ids` give each
    token's trajectory (for the trajectory masks). The engine correction is `correction` on `engine_logps`, or
    `tis_coef`, short for `Correction("tis", high=tis_coef)`. Metrics are detached means over the masked tokens
    (`clip_frac_low`/`_high`: the tokens whose clip took the gradient away).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (3 is a common choice), got {dual_clip}.")

    ratio = torch.exp(logps - old_logps)
    loss, metrics = _clipped_surrogate(ratio, advantages, clip_low, clip_high)

    negative = advantages < 0
    dual_clipped = torch.zeros_like(negative)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_clipped = negative & (loss > bound)
        loss = torch.where(negative, torch.minimum(loss, bound), loss)

    metrics |= {"dual_clip_frac": dual_clipped.float(), "approx_kl": k3(old_logps, logps)}
    return _finish_policy_loss(loss, metrics, old_logps, engine_logps, tis_coef, correction, mask, sample_ids)


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float,
                       clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """-min(ratio A, clip(ratio) A) per token, and where each side of the clip took the gradient away."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    value = ratio.detach()
    return torch.maximum(unclipped, clipped), {
        "clip_frac_low": ((value < 1.0 - clip_low) & (advantages < 0)).float(),
        "clip_frac_high": ((value > 1.0 + clip_high) & (advantages > 0)).float(),
    }


def per_sample(values: Tensor, mask: Tensor, sample_ids: Tensor, mean: bool = False) -> Tensor:
    """Each token's sample's sum (or `mean`, 0 for a sample without masked tokens) of `values` over that sample's
    masked tokens, differentiable in `values`. A sample's tokens may sit anywhere (a trajectory's sequences packed
    apart)."""
    _, index = torch.unique(sample_ids.flatten(), return_inverse=True)
    n_samples = int(index.max()) + 1 if index.numel() else 0
    counted = (mask > 0).flatten().to(values.dtype)
    sums = values.new_zeros(n_samples).index_add(0, index, values.flatten() * counted)
    if mean:
        sums = sums / counted.new_zeros(n_samples).index_add(0, index, counted).clamp(min=1.0)
    return sums[index].view_as(values)


def gspo_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, sample_ids: Tensor,
              clip_low: float = 3e-4, clip_high: float = 4e-4, token_level: bool = False,
              engine_logps: Tensor | None = None, tis_coef: float | None = None,
              correction: Correction | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071), per token.

    One ratio per sample, s_i = (pi(y_i | x) / pi_old(y_i | x))^(1 / |y_i|) = exp(mean_t (logp_t - old_logp_t)),
    clipped like PPO's at the sequence level with the paper's narrow ranges (sec. 5.1):
    loss_t = -min(s_i A_t, clip(s_i, 1 - clip_low, 1 + clip_high) A_t) for every token t of sample i; with
    `avg_level=sequence` and one advantage per sample, the paper's objective (sum_t grad s_i / |y_i| = grad s_i).
    `sample_ids` give every token of a trajectory one id, and all of them must be in this call.
    With `token_level`, GSPO-token: s_i,t = sg[s_i] * pi_t / sg[pi_t], the same value and clip, but token t's
    gradient A_t s_i grad log pi_t uses its own advantage (the same as GSPO's when A_t is the sample's).

    Arguments and metrics as in `ppo_loss`, plus `seq_ratio` (s_i); the tokens with mask > 0 make up |y_i|.
    """
    sequence_log_ratio = per_sample(logps - old_logps, mask, sample_ids, mean=True)
    if token_level:
        # Adding the constant last keeps the value exactly s_i (the difference of logps is 0).
        log_ratio = logps - logps.detach() + sequence_log_ratio.detach()
    else:
        log_ratio = sequence_log_ratio
    ratio = torch.exp(log_ratio)
    loss, metrics = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    metrics |= {"seq_ratio": ratio.detach(), "approx_kl": k3(old_logps, logps)}
    return _finish_policy_loss(loss, metrics, old_logps, engine_logps, tis_coef, correction, mask, sample_ids)


def cispo_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, clip_low: float | None = None,
               clip_high: float = 3.0, engine_logps: Tensor | None = None, tis_coef: float | None = None,
               correction: Correction | None = None,
               sample_ids: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): a clipped, detached importance weight times the log-prob.

    loss_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] A_t log pi_t, with r_t = exp(logp_t - old_logp_t).
    Where PPO's clip drops the gradient of a token whose ratio left the range (often a rare token that opens a
    new line of reasoning), CISPO only bounds its weight. The paper sets no lower bound (`clip_low=None`).

    Arguments and metrics as in `ppo_loss` (a clipped token keeps its gradient here), plus `is_weight`.
    """
    ratio = torch.exp(logps - old_logps).detach()
    low = None if clip_low is None else 1.0 - clip_low
    weight = ratio.clamp(min=low, max=1.0 + clip_high)
    loss = -weight * advantages * logps
    metrics = {
        "clip_frac_low": (ratio < low).float() if low is not None else torch.zeros_like(ratio),
        "clip_frac_high": (ratio > 1.0 + clip_high).float(),
        "is_weight": weight,
        "approx_kl": k3(old_logps, logps),
    }
    return _finish_policy_loss(loss, metrics, old_logps, engine_logps, tis_coef, correction, mask, sample_ids)
