"""Packed varlen attention on CUDA, forward and backward, against causal SDPA on each sequence alone.

Every test runs on the CPU too (shorter sequences, no kernel restriction or memory figure: SDPA has one
kernel there), so that its helpers cannot break unseen on a machine without a GPU.
"""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from RL2.models.attention import varlen_attention, varlen_backend
from RL2.models.context_parallel import ContextShard, _gathered_kv_attention

HEADS, KV_HEADS, DIM = 8, 2, 64
LENGTHS = [300, 17, 1, 512, 96, 1024, 33]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request) -> torch.device:
    return torch.device(request.param)


def per_sequence(query, key, value, lengths, scale):
    """Causal SDPA on each sequence alone, in float32: `[1, T, H, D]`."""
    outputs, start = [], 0
    for n in lengths:
        q, k, v = (x[:, :, start:start + n].float() for x in (query, key, value))
        outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True))
        start += n
    return torch.cat(outputs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 2e-5)])
def test_varlen_attention_forward_and_backward(device, dtype, tolerance):
    leaves = _leaves(device, dtype, LENGTHS)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    backend = varlen_backend(device, dtype)
    print(f"{dtype}: {backend}")
    out, _ = varlen_attention(None, *leaves, None, scaling=DIM**-0.5, cu_seq_lens_q=cu_seqlens,
                              max_length_q=max(LENGTHS))
    assert out.dtype == dtype and out.shape == (1, sum(LENGTHS), HEADS, DIM)
    _check_against_per_sequence(out, leaves, LENGTHS, tolerance)


@needs_cuda
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


# One long sequence (and a short one): SDPA's math kernel would hold [H, L, L] fp32 scores, 512 MiB here
# per call, more in backward; the efficient kernel holds none. On the CPU, where only the helpers' logic is
# checked, a shorter one.
LONG_LENGTHS = {"cuda": [4096, 100], "cpu": [512, 100]}


def _leaves(device, dtype, lengths, seed=0):
    generator = torch.Generator(device).manual_seed(seed)
    return [torch.randn(1, h, sum(lengths), DIM, device=device, generator=generator, dtype=dtype, requires_grad=True)
            for h in (HEADS, KV_HEADS, KV_HEADS)]


def _check_against_per_sequence(out, leaves, lengths, tolerance):
    expected = per_sequence(*leaves, lengths, DIM**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    weights = torch.randn(out.shape, device=out.device)
    ours = torch.autograd.grad((out.float() * weights).sum(), leaves)
    theirs = torch.autograd.grad((expected * weights).sum(), leaves)
    for name, a, b in zip(("query", "key", "value"), ours, theirs):
        scale = b.abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), atol=tolerance * scale, rtol=tolerance,
                                   msg=lambda m, name=name: f"d{name}: {m}")


def _attend_with_only_the_efficient_kernel(attend, leaves, device):
    """Forward and backward of `attend()`, the graph kept for the comparison's backward; on CUDA with SDPA's
    math and flash kernels switched off (a call only they take raises "No available kernel"), and the peak
    memory above what was allocated before (None on the CPU)."""
    if device.type == "cpu":
        out = attend()
        torch.autograd.grad(out.float().sum(), leaves, retain_graph=True)
        return out, None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = attend()
        torch.autograd.grad(out.float().sum(), leaves, retain_graph=True)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def test_fp32_grouped_heads_run_the_efficient_kernel_at_4096(device):
    """fp32 packed attention with grouped key/value heads (the per-sequence SDPA path) is taken by the
    memory-efficient kernel: the key/value heads are repeated, as `sdpa_repeats_kv_heads` decides."""
    lengths = LONG_LENGTHS[device.type]
    leaves = _leaves(device, torch.float32, lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    assert varlen_backend(device, torch.float32) == "sdpa"
    out, peak = _attend_with_only_the_efficient_kernel(
        lambda: varlen_attention(None, *leaves, None, scaling=DIM**-0.5, cu_seq_lens_q=cu_seqlens)[0], leaves, device)
    if peak is not None:
        scores = HEADS * lengths[0] ** 2 * 4
        print(f"fp32 packed attention at L={lengths[0]}: peak {peak / 2**20:.0f} MiB above the inputs "
              f"(math kernel scores: {scores / 2**20:.0f} MiB)")
        assert peak < scores / 4
    _check_against_per_sequence(out, leaves, lengths, 1e-4)


@pytest.fixture(scope="module")
def one_rank_groups():
    """One-rank groups for the context-parallel fallback (its all-gather is then a copy): NCCL's on a GPU,
    gloo's on the CPU, by device type."""
    made = not dist.is_initialized()
    if made:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    device_id=torch.device("cuda", 0))
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    groups = {"cpu": dist.new_group([0], backend="gloo")}
    if torch.cuda.is_available():
        groups["cuda"] = dist.new_group([0], backend="nccl")
    yield groups
    if made:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_context_parallel_fallback_runs_the_efficient_kernel_at_4096(device, one_rank_groups, dtype, tolerance):
    """The all-gather fallback of context parallelism passes a mask, which SDPA's flash kernel refuses,
    and grouped heads, which its efficient kernel refuses: with the heads repeated the efficient kernel
    takes it, in fp32 and bf16."""
    lengths = LONG_LENGTHS[device.type]
    leaves = _leaves(device, dtype, lengths, seed=1)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    shard = ContextShard.build(cu_seqlens, one_rank_groups[device.type])
    assert shard.local_rows.tolist() == list(range(sum(lengths)))  # even lengths: no padding at cp=1
    out, peak = _attend_with_only_the_efficient_kernel(
        lambda: _gathered_kv_attention(*leaves, shard, DIM**-0.5), leaves, device)
    if peak is not None:
        print(f"context-parallel fallback, {dtype}, L={lengths[0]}: peak {peak / 2**20:.0f} MiB above the inputs")
        assert peak < HEADS * lengths[0] ** 2 * dtype.itemsize / 2  # the math kernel holds at least this twice
    _check_against_per_sequence(out, leaves, lengths, tolerance)
