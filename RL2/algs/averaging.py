"""How per-token losses are averaged over a global batch (`avg_level`: token, DAPO's; sequence, GRPO's; constant,
Dr. GRPO's, arXiv 2503.20783, with the generation budget as the constant; docs/rl.md): one weight per label. The
loss is `sum(per_token_loss * weights)`; each micro-batch and rank adds its labels' share, so the sum is the
configured average whatever the split (the weights are computed once, on the whole batch, before packing)."""

import torch
from torch import Tensor

AVERAGING_LEVELS = ("token", "sequence", "constant")


def loss_weights(loss_mask: Tensor, sample_of_label: Tensor, n_samples: int, level: str,
                 constant: int | None = None) -> Tensor:
    """Per-label weights of the loss over a whole batch at `level`: `[n_labels]`, 0 where `loss_mask` is 0,
    summing to 1 ("constant": to the trained tokens over `constant * n_samples`). `sample_of_label` (long)
    is `[n_labels]` too; `n_samples`: the samples averaged over, which may include some without trained labels
    (a trajectory left out of training is not one of them)."""
    if level == "token":
        return loss_mask / loss_mask.sum().clamp(min=1.0)
    if level == "sequence":
        per_sample = torch.bincount(sample_of_label, weights=loss_mask).to(loss_mask.dtype)
        return loss_mask / (per_sample[sample_of_label].clamp(min=1.0) * max(n_samples, 1))
    if level == "constant":
        if not constant or constant <= 0:
            raise ValueError("avg_level=constant needs a positive normaliser (the generation budget)")
        return loss_mask / (constant * max(n_samples, 1))
    raise ValueError(f"unknown avg_level {level!r}; choose one of {', '.join(AVERAGING_LEVELS)}")
