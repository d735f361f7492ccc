"""PPO's critic loss as a pure tensor function (the layout of `RL2.algs.policy_loss`)."""

import torch
from torch import Tensor


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = None) -> Tensor:
    """PPO critic loss 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), per token.

    Value clipping as in the PPO reference implementation (OpenAI baselines ppo2): the new value may
    not move more than `clip` from the rollout-time one to reduce the loss (None: a plain squared error).
    """
    loss = (values - returns).pow(2)
    if clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped_values - returns).pow(2))
    return 0.5 * loss * (mask > 0)
