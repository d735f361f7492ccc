"""Packed varlen attention on CUDA, forward and backward, against causal SDPA on each sequence alone."""

import pytest
import torch
import torch.nn.functional as F

from RL2.models.attention import varlen_attention, varlen_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, KV_HEADS, DIM = 8, 2, 64
LENGTHS = [300, 17, 1, 512, 96, 1024, 33]


def per_sequence(query, key, value, lengths, scale):
    """Causal SDPA on each sequence alone, in float32: `[1, T, H, D]`."""
    outputs, start = [], 0
    for n in lengths:
        q, k, v = (x[:, :, start:start + n].float() for x in (query, key, value))
        outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True))
        start += n
    return torch.cat(outputs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 2e-5)])
def test_varlen_attention_forward_and_backward(dtype, tolerance):
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    total = sum(LENGTHS)
    leaves = [torch.randn(1, h, total, DIM, device=device, generator=generator, dtype=dtype, requires_grad=True)
              for h in (HEADS, KV_HEADS, KV_HEADS)]
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    backend = varlen_backend(device, dtype)
    print(f"{dtype}: {backend}")
    out, _ = varlen_attention(None, *leaves, None, scaling=DIM**-0.5, cu_seq_lens_q=cu_seqlens,
                              max_length_q=max(LENGTHS))
    assert out.dtype == dtype and out.shape == (1, total, HEADS, DIM)
    expected = per_sequence(*leaves, LENGTHS, DIM**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    weights = torch.randn(out.shape, device=device, generator=generator)
    ours = torch.autograd.grad((out.float() * weights).sum(), leaves)
    theirs = torch.autograd.grad((expected * weights).sum(), leaves)
    for name, a, b in zip(("query", "key", "value"), ours, theirs):
        scale = b.abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), atol=tolerance * scale, rtol=tolerance,
                                   msg=lambda m, name=name: f"d{name}: {m}")


def test_half_precision_takes_a_flash_kernel_when_torch_has_one():
    """bf16 runs flash-attn's kernel or torch's own, not the per-sequence loop, whenever either exists and
    this GPU runs it (Ampere or newer: flash-attn fails the call on a V100 or T4; grouped key/value heads
    too: they are repeated for a torch kernel without `enable_gqa`)."""
    from RL2.models.attention import flash_attn_varlen, torch_varlen_attention

    backend = varlen_backend(torch.device("cuda"), torch.bfloat16)
    ampere = torch.cuda.get_device_capability()[0] >= 8
    if flash_attn_varlen() is not None and ampere:
        assert backend == "flash_attn"
    elif torch_varlen_attention() is not None and ampere:
        assert backend == "torch_varlen"
    else:
        assert backend == "sdpa"
    print(f"bf16 packed attention on this machine: {backend}")
