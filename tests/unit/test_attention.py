"""The CPU varlen attention against causal attention written out per sequence in float64."""

import pytest
import torch
import torch.nn.functional as F

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


def test_per_sequence_path_is_exact_in_float64():
    """The path CUDA takes without a flash kernel (SDPA per sequence in the input's own dtype), here in float64."""
    lengths = [13, 1, 40, 7]
    generator = torch.Generator().manual_seed(1)
    total = sum(lengths)
    query = torch.randn(1, HEADS, total, DIM, generator=generator, dtype=torch.float64)
    key = torch.randn(1, KV_HEADS, total, DIM, generator=generator, dtype=torch.float64)
    value = torch.randn(1, KV_HEADS, total, DIM, generator=generator, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = varlen_attention(None, query, key, value, None, scaling=0.25, cu_seq_lens_q=cu_seqlens)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(query, key, value, lengths, 0.25), atol=1e-12, rtol=1e-12)


class _VarlenWithGQA:
    """Stands in for torch's `varlen_attn` in the choice tests (only its signature is read)."""

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
        raise AssertionError("not called by the choice")


def _varlen_without_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, is_causal=False):
    raise AssertionError("not called by the choice")


@pytest.mark.parametrize("flash, varlen, capability, dtype, expected", [
    (True, _VarlenWithGQA(), (9, 0), torch.bfloat16, "flash_attn"),
    (True, _VarlenWithGQA(), (9, 0), torch.float32, "sdpa"),  # flash kernels take fp16/bf16 only
    (False, _VarlenWithGQA(), (9, 0), torch.float16, "torch_varlen"),
    (False, _VarlenWithGQA(), (7, 5), torch.bfloat16, "sdpa"),  # torch's flash kernel needs Ampere
    (True, _VarlenWithGQA(), (7, 0), torch.float16, "sdpa"),  # so does flash-attn's (a V100 or T4 fails the call)
    (True, None, (8, 0), torch.float16, "flash_attn"),
    (False, _varlen_without_gqa, (8, 0), torch.bfloat16, "torch_varlen"),  # grouped heads are repeated for it
    (False, None, (9, 0), torch.bfloat16, "sdpa"),
])
def test_cuda_backend_choice(monkeypatch, flash, varlen, capability, dtype, expected):
    """Which kernel a CUDA forward would take, from what is installed (the CUDA checks run in tests/gpu)."""
    from RL2.models import attention

    monkeypatch.setattr(attention, "flash_attn_varlen", lambda: object() if flash else None)
    monkeypatch.setattr(attention, "torch_varlen_attention", lambda: varlen)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert attention.varlen_backend(torch.device("cuda", 0), dtype) == expected


@pytest.mark.parametrize("with_gqa_keyword", [False, True])
def test_torch_varlen_call_with_grouped_heads(monkeypatch, with_gqa_keyword):
    """The arguments `_torch_varlen` hands torch's kernel, checked with a stand-in that computes what the
    kernel's documentation says (causal attention within each `cu_seq` span, `(T, H, D)` layout) and,
    like torch releases before `enable_gqa`, refuses fewer key/value heads than query heads unless told.
    Output and gradients must equal causal SDPA on each sequence alone."""
    from RL2.models import attention

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kwargs):
        assert window_size == (-1, 0) and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        assert kwargs.get("enable_gqa", False) or q.shape[1] == k.shape[1]
        bounds = cu_q.tolist()
        outs = [F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                               scale=scale, enable_gqa=True).transpose(0, 1)
                for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs)

    if with_gqa_keyword:
        def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
            return kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                          enable_gqa=enable_gqa)
    else:
        def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            return kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    monkeypatch.setattr(attention, "torch_varlen_attention", lambda: varlen)
    lengths = [5, 1, 9, 3]
    generator = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, heads, sum(lengths), 8, generator=generator, dtype=torch.float64, requires_grad=True)
              for heads in (HEADS, KV_HEADS, KV_HEADS)]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = attention._torch_varlen(*leaves, cu_seqlens, max(lengths), 0.3)
    expected = reference(*leaves, lengths, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    ours = torch.autograd.grad((out * weights).sum(), leaves)
    theirs = torch.autograd.grad((expected * weights).sum(), leaves)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_cpu_always_takes_the_exact_path():
    from RL2.models.attention import varlen_backend
    from RL2.models.context_parallel import context_parallel_backend

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert varlen_backend(torch.device("cpu"), dtype) == "sdpa"
        assert context_parallel_backend(torch.device("cpu"), dtype) == "all_gather_kv"


def test_context_parallel_falls_back_without_ring_flash_attn(monkeypatch):
    from RL2.models import context_parallel

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(context_parallel, "flash_attn_varlen", lambda: object())
    monkeypatch.setattr(context_parallel, "_ring_flash_attn_module", lambda: None)
    assert context_parallel.context_parallel_backend(torch.device("cuda", 0), torch.bfloat16) == "all_gather_kv"
    monkeypatch.setattr(context_parallel, "_ring_flash_attn_module", lambda: object())
    assert context_parallel.context_parallel_backend(torch.device("cuda", 0), torch.bfloat16) == "ring_flash_attn"
    assert context_parallel.context_parallel_backend(torch.device("cuda", 0), torch.float32) == "all_gather_kv"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # flash-attn refuses it
    assert context_parallel.context_parallel_backend(torch.device("cuda", 0), torch.bfloat16) == "all_gather_kv"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(context_parallel, "flash_attn_varlen", lambda: None)
    assert context_parallel.context_parallel_backend(torch.device("cuda", 0), torch.bfloat16) == "all_gather_kv"


@pytest.mark.parametrize("device, dtype, heads, kv_heads, masked, capability, repeats", [
    ("cuda", torch.float32, 8, 2, False, (9, 0), True),  # flash refuses fp32, efficient refuses grouped heads
    ("cuda", torch.float32, 8, 2, True, (9, 0), True),
    ("cuda", torch.bfloat16, 8, 2, True, (9, 0), True),  # flash refuses any mask (the CP fallback's)
    ("cuda", torch.bfloat16, 8, 2, False, (9, 0), False),  # flash takes grouped heads itself
    ("cuda", torch.float16, 8, 2, False, (7, 5), True),  # no flash kernel before Ampere
    ("cuda", torch.float32, 8, 8, True, (9, 0), False),  # nothing to repeat
    ("cpu", torch.float32, 8, 2, True, (9, 0), False),  # the CPU's math kernel is the only one: as before
    ("cpu", torch.bfloat16, 8, 2, False, (9, 0), False),
])
def test_sdpa_repeats_kv_heads_where_only_the_math_kernel_would_take_grouped_heads(
        monkeypatch, device, dtype, heads, kv_heads, masked, capability, repeats):
    """The choice SDPA's callers make on CUDA (the kernels' constraints are in torch's sdp_utils.cpp;
    tests/gpu/test_cuda_attention.py runs the call with only the efficient kernel allowed)."""
    from RL2.models.attention import sdpa_repeats_kv_heads

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert sdpa_repeats_kv_heads(torch.device(device), dtype, heads, kv_heads, masked) is repeats


@pytest.mark.parametrize("masked", [False, True])
def test_repeated_kv_heads_give_the_grouped_attention(monkeypatch, masked):
    """`sdpa` with key/value heads repeated (what a CUDA fp32 or masked call does) gives the output and
    the key/value gradients of grouped attention (`enable_gqa`), checked on CPU by forcing the repeat."""
    from RL2.models import attention

    generator = torch.Generator().manual_seed(2)
    n = 23
    leaves = [torch.randn(1, heads, n, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
              for heads in (HEADS, KV_HEADS, KV_HEADS)]
    mask = torch.rand(n, n, generator=generator).tril() > 0.3 if masked else None
    if masked:
        mask.diagonal().fill_(True)  # every query sees a key
    grouped = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=not masked, scale=0.3,
                                             enable_gqa=True)
    repeated_calls = []
    real = attention.sdpa_repeats_kv_heads
    monkeypatch.setattr(attention, "sdpa_repeats_kv_heads",
                        lambda *args: repeated_calls.append(args) or real(*args) or True)
    out = attention.sdpa(*leaves, scaling=0.3, mask=mask)
    assert repeated_calls
    torch.testing.assert_close(out, grouped, atol=1e-12, rtol=1e-12)
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    ours = torch.autograd.grad((out * weights).sum(), leaves)
    theirs = torch.autograd.grad((grouped * weights).sum(), leaves)
    for name, a, b in zip(("query", "key", "value"), ours, theirs):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m, name=name: f"d{name}: {m}")


def test_the_choice_is_logged_once(capsys):
    from RL2.models import attention

    attention._LOGGED.clear()
    query = torch.randn(1, HEADS, 6, DIM)
    key = value = torch.randn(1, KV_HEADS, 6, DIM)
    for _ in range(3):
        varlen_attention(None, query, key, value, None)
    assert capsys.readouterr().out.count("packed attention: sdpa (cpu, float32)") == 1
