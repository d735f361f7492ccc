"""Forward a packed micro-batch and read off per-token log-probabilities."""

import torch
import torch.nn.functional as F

from RL2.datasets.packing import MicroBatch


def forward_packed(model: torch.nn.Module, mb: MicroBatch):
    """Run the model on one packed row; attention stays within each sequence (see RL2.models.attention)."""
    max_len = max(mb.seq_lens)
    return model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        cu_seq_lens_q=mb.cu_seqlens,
        cu_seq_lens_k=mb.cu_seqlens,
        max_length_q=max_len,
        max_length_k=max_len,
        use_cache=False,
    )


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels[t] | prefix) in float32, `[1, T]`. Cross-entropy keeps one `[T, V]` float32 copy."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return -F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view_as(labels)


def packed_logps(model: torch.nn.Module, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    return token_logps(forward_packed(model, mb).logits, mb.labels, temperature)
