"""PPO's critic loss as a pure tensor function (the layout of `RL2.algs.policy_loss`)."""

import torch
from torch import Tensor


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = None) -> Tensor:
    """PPO critic loss 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), per token.

    Value clipping as in the PPO reference implementation (OpenAI baselines ppo2): the new value may
    not move more than `clip` from the old one to reduce the loss (None: a plain squared error).
    `values` (current, with grad), `old_values` (at rollout time), `returns` (the targets, e.g. `gae`'s)
    and `mask` (1.0 on action tokens) are `[B, T]`; so are the losses, 0 where `mask` is 0.
    """
    loss = (values - returns).pow(2)
    if clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped_values - returns).pow(2))
    return 0.5 * loss * (mask > 0)
