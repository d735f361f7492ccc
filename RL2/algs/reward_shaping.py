"""Reward shaping on trajectory-level tensors (one number per sample, `[batch]`), added to the verifier's scores
before the advantage estimator runs."""

from torch import Tensor


def overlong_penalty(response_lengths: Tensor, max_new_tokens: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13).

    With L_max = `max_new_tokens` and L_cache = `buffer_len`:
        0                                   if |y| <= L_max - L_cache,
        ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max,
        -1                                  if |y| > L_max,
    times `penalty_factor`. Answers that hit the budget are penalised gradually rather than
    through truncation, which would otherwise reward sound reasoning that ran out of room with 0.
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"buffer_len must be in (0, max_new_tokens={max_new_tokens}], got {buffer_len}.")
    excess = response_lengths.float() - (max_new_tokens - buffer_len)
    return -penalty_factor * (excess / buffer_len).clamp(0.0, 1.0)


def length_penalty(response_lengths: Tensor, coef: float, max_new_tokens: int | None = None) -> Tensor:
    """Linear length shaping -coef * |y| (or -coef * |y| / max_new_tokens when given); a negative `coef`
    rewards length instead."""
    lengths = response_lengths.float()
    if max_new_tokens is not None:
        lengths = lengths / max_new_tokens
    return -coef * lengths
