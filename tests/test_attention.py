"""The CPU varlen attention against causal attention written out per sequence in float64."""

import pytest
import torch

from RL2.models.attention import varlen_attention

HEADS, KV_HEADS, DIM = 4, 2, 8


def reference(query, key, value, lengths, scale):
    """softmax(q k^T * scale + causal mask) v for each sequence alone, `[1, T, H, D]` in float64."""
    outputs, start = [], 0
    for n in lengths:
        q = query[0, :, start : start + n].double()
        k = key[0, :, start : start + n].double().repeat_interleave(HEADS // KV_HEADS, 0)
        v = value[0, :, start : start + n].double().repeat_interleave(HEADS // KV_HEADS, 0)
        scores = q @ k.transpose(-1, -2) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outputs.append(scores.softmax(-1) @ v)
        start += n
    return torch.cat(outputs, dim=1).transpose(0, 1).unsqueeze(0)


@pytest.mark.parametrize("lengths", [[30, 28, 31, 25, 29], [60, 5, 3, 9], [17]])
def test_varlen_attention_equals_attention_per_sequence(lengths):
    """No token attends across a sequence boundary; outputs and gradients as for each sequence alone."""
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    query = torch.randn(1, HEADS, total, DIM, generator=generator, requires_grad=True)
    key = torch.randn(1, KV_HEADS, total, DIM, generator=generator, requires_grad=True)
    value = torch.randn(1, KV_HEADS, total, DIM, generator=generator, requires_grad=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = varlen_attention(None, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu_seqlens)
    expected = reference(query, key, value, lengths, 0.3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn(out.shape, generator=generator)
    ours = torch.autograd.grad((out * weights).sum(), (query, key, value))
    theirs = torch.autograd.grad((expected * weights.double()).sum(), (query, key, value))
    for name, a, b in zip(("query", "key", "value"), ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")
