"""Per-token estimators of KL(p || q) from samples x ~ p (J. Schulman, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html), registered by name in `KL_ESTIMATORS`. Tensors are in the layout of
`RL2.algs.advantages` (the caller masks); `logps` are under p (the sampling policy), `ref_logps` under q, and
log r = logp - ref_logp = log p(x) - log q(x)."""

from collections.abc import Callable

import torch
from torch import Tensor


def k1(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k1 = log r: unbiased, high variance, can be negative."""
    return logps - ref_logps


def k2(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k2 = 0.5 (log r)^2: biased, low variance; used as a loss on samples of p, its gradient (log r) grad log p
    equals grad KL(p || q) in expectation."""
    return 0.5 * (logps - ref_logps).pow(2)


def k3(logps: Tensor, ref_logps: Tensor, log_ratio_clamp: float | None = None) -> Tensor:
    """k3 = (q/p - 1) - log(q/p) = exp(-log r) - 1 + log r: unbiased, always >= 0, low variance.

    `log_ratio_clamp`: if set, clamp log r to [-c, c] first. exp(-log r) overflows float32 once -log r
    exceeds ~88, which happens when p has drifted far from q on a rare token.
    """
    log_ratio = logps - ref_logps
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    return torch.exp(-log_ratio) - 1 + log_ratio


KL_ESTIMATORS: dict[str, Callable[..., Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


def compute_kl(name: str, logps: Tensor, ref_logps: Tensor) -> Tensor:
    """The KL estimator registered under `name` (a key of `KL_ESTIMATORS`) of KL(p || q)."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"Unknown KL estimator {name!r}; valid names: {sorted(KL_ESTIMATORS)}.")
    return KL_ESTIMATORS[name](logps, ref_logps)
