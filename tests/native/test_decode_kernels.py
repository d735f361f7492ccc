"""The C decode kernels, each against the torch computation it replaces (in float64 where that is the
independent reference), on shapes that reach their edge cases: rows at different positions in a
larger cache, sharp attention, silu far into both tails, and enough rows for the threaded branch."""

import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from RL2.engine.embedded import llama_forward, packed_linear
from RL2.native.decode_kernels import DecodeKernels, RowGroups, load_decode_kernels

KERNELS = load_decode_kernels()
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason="the C decode kernels are unavailable here (no C compiler, or RL2_DECODE_KERNELS=0)"
)


def randn(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows", [3, 200])  # 200 x 576 takes the OpenMP branch
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_the_residual_add_then_hf_rmsnorm(rows, with_delta):
    dim = 576
    hidden, delta = randn(rows, dim, scale=3.0), randn(rows, dim, seed=1)
    norm = LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(dim, seed=2))
    expected_hidden = hidden + delta if with_delta else hidden.clone()
    expected = norm(expected_hidden)
    out = torch.empty_like(hidden)
    KERNELS.add_rms_norm(hidden, delta if with_delta else None, norm.weight.detach(), 1e-5, out)
    torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=0)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [4, 64])  # 64 x 1536 takes the OpenMP branch
def test_silu_mul_matches_float64_over_both_tails(rows):
    width = 1536
    gate_up = randn(rows, 2 * width, scale=4.0)
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = torch.empty(rows, width)
    KERNELS.silu_mul(gate_up, out)
    torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("rows", [3, 60])  # 60 x 160 takes the OpenMP branch
@pytest.mark.parametrize("norms", [False, True], ids=["llama", "qwen3-norms"])
def test_rope_and_store_rotates_q_and_writes_k_v_at_each_rows_position(norms, rows):
    heads, kv_heads, head_dim, cache_rows, cache_len = 6, 2, 16, 64, 20
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim)
    positions = torch.randint(0, cache_len, (rows,), generator=torch.Generator().manual_seed(7))
    positions[:2] = torch.tensor([0, cache_len - 1])
    angles = positions[:, None].double() * (10000.0 ** (-torch.arange(0, head_dim, 2).double() / head_dim))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().float(), angles.sin().float()
    keys, values = (randn(cache_rows, kv_heads, cache_len, head_dim, seed=3),
                    randn(cache_rows, kv_heads, cache_len, head_dim, seed=4))
    expected_keys, expected_values = keys.clone(), values.clone()

    q, k, v = qkv.view(rows, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    q_norm = k_norm = None
    if norms:
        q_norm, k_norm = LlamaRMSNorm(head_dim, eps=1e-6), LlamaRMSNorm(head_dim, eps=1e-6)
        with torch.no_grad():
            q_norm.weight.copy_(randn(head_dim, seed=5))
            k_norm.weight.copy_(randn(head_dim, seed=6))
            q, k = q_norm(q), k_norm(k)
    # HF's rotation: [batch, heads, seq, dim] with cos/sin [batch, seq, dim]
    expected_q, rotated_k = apply_rotary_pos_emb(q[:, :, None], k[:, :, None], cos[:, None], sin[:, None])
    for row, position in enumerate(positions):
        expected_keys[row, :, position] = rotated_k[row, :, 0]
        expected_values[row, :, position] = v[row]

    q_out = torch.empty(rows, heads, head_dim)
    KERNELS.rope_and_store(
        qkv, cos, sin, positions, q_norm and q_norm.weight.detach(), k_norm and k_norm.weight.detach(), 1e-6,
        q_out, keys, values,
    )
    torch.testing.assert_close(q_out, expected_q[:, :, 0].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, expected_keys.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0)


@pytest.fixture(scope="module")
def avx2_kernels(tmp_path_factory) -> DecodeKernels:
    """The library built for AVX2 on an AVX512 CPU (where the native build is AVX512's)."""
    if not torch.cpu._is_avx512_supported() or shutil.which("cc") is None:
        pytest.skip("needs an AVX512 CPU (whose native build differs from the AVX2 one) and cc")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RL2_MARCH", "haswell")
        env.setenv("RL2_CACHE", str(tmp_path_factory.mktemp("avx2")))
        return load_decode_kernels.__wrapped__()  # built again, past the cache of the native build


# (heads, kv_heads, head_dim): head dims that are multiples of the vector width (16 lanes with AVX512, 8 with
# AVX2) score keys a vector at a time; multiples of 4 vectors weigh values for several heads at once (7 heads
# a kv head: a group of four, then three, with AVX512); others take the generic code.
ATTENTION_SHAPES = [(9, 3, 64), (14, 2, 128), (4, 4, 32), (6, 2, 40)]


def float64_attention(q, keys, values, positions, scale) -> torch.Tensor:
    """`[rows, heads, head_dim]`: each row's query over its cache positions 0..positions[row], in float64."""
    rows, heads, head_dim = q.shape
    group = heads // keys.shape[1]
    expected = torch.empty(rows, heads, head_dim, dtype=torch.float64)
    for row, position in enumerate(positions.tolist()):
        k = keys[row, :, : position + 1].double().repeat_interleave(group, dim=0)
        v = values[row, :, : position + 1].double().repeat_interleave(group, dim=0)
        scores = (q[row].double()[:, None] @ k.transpose(-1, -2))[:, 0] * scale
        expected[row] = (scores.softmax(-1)[:, None] @ v)[:, 0]
    return expected


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", ATTENTION_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("score_scale", [1.0, 30.0], ids=["soft", "sharp"])
def test_decode_attention_matches_float64_attention_over_each_rows_prefix(
    score_scale, heads, kv_heads, head_dim, build, request
):
    kernels = KERNELS if build == "native" else request.getfixturevalue("avx2_kernels")
    rows, cache_rows, cache_len = 7, 9, 130
    positions = torch.tensor([0, 1, 5, 63, 64, 100, 129])
    q = randn(rows, heads, head_dim, scale=score_scale)
    keys, values = (randn(cache_rows, kv_heads, cache_len, head_dim, seed=1),
                    randn(cache_rows, kv_heads, cache_len, head_dim, seed=2))
    scale = 1 / math.sqrt(head_dim)
    expected = float64_attention(q, keys, values, positions, scale)
    out = torch.empty(rows, heads * head_dim)
    kernels.decode_attention(q, keys, values, positions, scale, out)
    torch.testing.assert_close(out.view(rows, heads, head_dim).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_rows_of_a_group_read_their_shared_prompt_once_with_the_same_results(dtype, build, request):
    """Groups of rows that hold copies of one prompt (as `SlotKVCache` has after a GRPO group's prefill) give,
    bit for bit, what each row gives reading all of its own cache, which the tests above check against
    float64; and they do read the shared positions from the group's first row only: the other rows' copies
    of those positions are overwritten with garbage before the grouped call."""
    kernels = KERNELS if build == "native" else request.getfixturevalue("avx2_kernels")
    heads, kv_heads, head_dim, cache_rows, cache_len = 9, 3, 64, 8, 96
    keys, values = (randn(cache_rows, kv_heads, cache_len, head_dim, seed=1),
                    randn(cache_rows, kv_heads, cache_len, head_dim, seed=2))
    keys, values = keys.to(dtype), values.to(dtype)
    # rows 0, 2, 5 share 37 positions (read once up to 32, a whole number of vectors), rows 6, 1 share 16
    # (listed in that order), rows 3 and 4 have their own prompts; lengths differ inside a group
    groups = RowGroups(order=torch.tensor([0, 2, 5, 6, 1, 3, 4]), starts=torch.tensor([0, 3, 5, 6, 7]),
                       shared=torch.tensor([37, 16, 0, 0]))
    positions = torch.tensor([40, 20, 95, 10, 0, 37, 16])
    for first, members, shared in [(0, [2, 5], 37), (6, [1], 16)]:
        for row in members:
            keys[row, :, :shared], values[row, :, :shared] = keys[first, :, :shared], values[first, :, :shared]
    q = randn(7, heads, head_dim, scale=3.0, seed=3)
    scale = 1 / math.sqrt(head_dim)
    row_by_row = torch.empty(7, heads * head_dim, dtype=dtype)
    kernels.decode_attention(q, keys, values, positions, scale, row_by_row)
    for row, read_once in [(2, 32), (5, 32), (1, 16)]:
        keys[row, :, :read_once], values[row, :, :read_once] = float("nan"), float("nan")
    grouped = torch.empty(7, heads * head_dim, dtype=dtype)
    kernels.decode_attention(q, keys, values, positions, scale, grouped, groups)
    assert torch.equal(grouped, row_by_row)


def bf16_cache(rows, kv_heads, cache_len, head_dim, zero_keys=False):
    """A bf16 model's cache as `SlotKVCache` holds it for the kernels: keys and values bf16."""
    keys = randn(rows + 2, kv_heads, cache_len, head_dim, seed=1) * (0.0 if zero_keys else 1.0)
    return keys.bfloat16(), randn(rows + 2, kv_heads, cache_len, head_dim, seed=2).bfloat16()


@pytest.mark.parametrize("heads,kv_heads,head_dim", ATTENTION_SHAPES, ids=lambda x: str(x))
def test_decode_attention_over_bf16_values_matches_float64(heads, kv_heads, head_dim):
    """Rounding the probabilities to bf16 moves each by at most 2^-9 of itself, so the float32 sum is within
    2^-9 max|v| of float64 attention over the same values; the bf16 output then within 2^-8 of that sum."""
    rows, positions = 7, torch.tensor([0, 1, 5, 63, 64, 100, 129])
    q = randn(rows, heads, head_dim, scale=3.0).bfloat16().float()  # a bf16 model's q, widened
    keys, values = bf16_cache(rows, kv_heads, 256, head_dim)
    scale = 1 / math.sqrt(head_dim)
    expected = float64_attention(q, keys, values, positions, scale)
    out = torch.empty(rows, heads * head_dim, dtype=torch.bfloat16)
    KERNELS.decode_attention(q, keys, values, positions, scale, out)
    bound = 2**-9 * float(values.abs().max()) + 1e-5 + 2**-8 * expected.abs()
    error = (out.view(rows, heads, head_dim).double() - expected).abs()
    assert (error <= bound).all(), f"worst excess over the bound: {float((error - bound).max())}"


def test_decode_attention_over_bf16_values_rounds_the_probabilities_as_the_torch_ops_do():
    """With zero keys a row at position p weighs its p + 1 values by 1 / (p + 1), rounded to bf16 (as
    `attend_one_token` does before its bf16 product), then sums in float32 and rounds the sum to bf16."""
    rows, heads, kv_heads, head_dim = 4, 6, 2, 64
    positions = torch.tensor([0, 2, 5, 99])
    keys, values = bf16_cache(rows, kv_heads, 128, head_dim, zero_keys=True)
    out = torch.empty(rows, heads * head_dim, dtype=torch.bfloat16)
    KERNELS.decode_attention(randn(rows, heads, head_dim), keys, values, positions, 0.125, out)
    for row, position in enumerate(positions.tolist()):
        weight = float(torch.tensor(1 / (position + 1)).bfloat16())
        per_kv_head = values[row, :, : position + 1].double().sum(1) * weight
        expected = per_kv_head.repeat_interleave(heads // kv_heads, dim=0)
        # the float32 sum is within ~1e-6 of the float64 one, so its rounding to bf16 is expected's but at ties
        torch.testing.assert_close(out[row].view(heads, head_dim).double(), expected, rtol=2**-8, atol=1e-6)
        assert (out[row].view(heads, head_dim) == expected.bfloat16()).float().mean() > 0.99


# ---- The bf16 step kernels against the torch ops of `llama_forward.py` that they replace, run in bf16: those
# round every op's result to bf16, and so must the kernels. Both sum a row's squares in their own order, so a
# result may land on the other side of a rounding boundary now and then: one bf16 step apart, rarely.


def assert_rounded_alike(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype == torch.bfloat16 and out.shape == expected.shape
    step = 2.0 ** (torch.frexp(expected.float())[1] - 8).float()  # one bf16 step at expected's magnitude
    assert ((out.float() - expected.float()).abs() <= step).all(), "more than one bf16 step from the torch ops"
    same = (out == expected).float().mean()
    assert same > 0.99, f"only {float(same):.1%} of the values bit-identical to the torch ops"


@pytest.mark.parametrize("rows", [3, 200])  # 200 x 576 takes the OpenMP branch
def test_add_rms_norm_in_bf16_rounds_as_the_torch_ops(rows):
    dim, eps = 576, 1e-5
    hidden, delta = randn(rows, dim, scale=3.0).bfloat16(), randn(rows, dim, seed=1).bfloat16()
    weight = (1 + randn(dim, seed=2, scale=0.3)).bfloat16()
    expected_hidden = hidden + delta
    expected = F.rms_norm(expected_hidden, (dim,), weight, eps)
    out = torch.empty_like(hidden)
    KERNELS.add_rms_norm(hidden, delta, weight, eps, out)
    assert torch.equal(hidden, expected_hidden)
    assert_rounded_alike(out, expected)


@pytest.mark.parametrize("rows", [4, 64])  # 64 x 1536 takes the OpenMP branch
def test_silu_mul_in_bf16_rounds_as_the_torch_ops(rows):
    width = 1536
    gate_up = randn(rows, 2 * width, scale=4.0).bfloat16()
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.empty(rows, width, dtype=torch.bfloat16)
    KERNELS.silu_mul(gate_up, out)
    assert_rounded_alike(out, F.silu(gate) * up)


@pytest.mark.parametrize("norms", [False, True], ids=["llama", "qwen3-norms"])
def test_rope_and_store_in_bf16_rounds_as_the_torch_ops(norms):
    rows, heads, kv_heads, head_dim, cache_len = 40, 6, 2, 64, 20
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim, scale=2.0).bfloat16()
    positions = torch.randint(0, cache_len, (rows,), generator=torch.Generator().manual_seed(7))
    angles = positions[:, None].double() * (10000.0 ** (-torch.arange(0, head_dim, 2).double() / head_dim))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()  # HF's rotary hands them over in the model's dtype
    keys = randn(rows, kv_heads, cache_len, head_dim, seed=3).bfloat16()
    values = randn(rows, kv_heads, cache_len, head_dim, seed=4).bfloat16()
    expected_keys, expected_values = keys.clone(), values.clone()

    heads_of = qkv.view(rows, heads + 2 * kv_heads, head_dim)
    qk, v = heads_of[:, : heads + kv_heads], heads_of[:, heads + kv_heads :]
    q_norm = k_norm = None
    if norms:
        q_norm, k_norm = (1 + randn(head_dim, seed=5, scale=0.3)).bfloat16(), (1 + randn(head_dim, seed=6)).bfloat16()
        q, k = qk.split([heads, kv_heads], dim=1)
        qk = torch.cat([F.rms_norm(q, (head_dim,), q_norm, 1e-6), F.rms_norm(k, (head_dim,), k_norm, 1e-6)], dim=1)
    half = head_dim // 2
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    rotated = llama_forward._rotate(qk, cos[:, None], signed_sin[:, None])
    for row, position in enumerate(positions):
        expected_keys[row, :, position] = rotated[row, heads:]
        expected_values[row, :, position] = v[row]

    q_out = torch.empty(rows, heads, head_dim)
    KERNELS.rope_and_store(qkv, cos, sin, positions, q_norm, k_norm, 1e-6, q_out, keys, values)
    assert_rounded_alike(q_out.bfloat16(), rotated[:, :heads])
    assert torch.equal(q_out.bfloat16().float(), q_out), "q holds bf16 values"
    assert_rounded_alike(keys, expected_keys)
    assert torch.equal(values, expected_values)


def test_a_cache_not_in_the_model_dtype_is_refused():
    """The C code would read float32 keys as pairs of bf16 (or write bf16 into float32 ones): garbage."""
    rows, heads, kv_heads, head_dim = 2, 4, 2, 64
    keys, values = bf16_cache(rows, kv_heads, 16, head_dim)
    positions, out = torch.tensor([3, 5]), torch.empty(rows, heads * head_dim, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="keys torch.float32"):
        KERNELS.decode_attention(randn(rows, heads, head_dim), keys.float(), values, positions, 0.125, out)
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim).bfloat16()
    cos = sin = torch.ones(rows, head_dim, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="keys torch.float32"):
        KERNELS.rope_and_store(qkv, cos, sin, positions, None, None, 0.0, torch.empty(rows, heads, head_dim),
                               keys.float(), values)


# Layers of 5, 9 and 11 outputs: panel boundaries (every 6 or 12) fall inside layers, and the last panel
# is partial; with a fourth layer of 23, 48 outputs fill whole panels, taken two at a time with AVX512.
LAYER_WIDTHS = [(5, 9, 11), (5, 9, 11, 23)]


@pytest.mark.parametrize("widths", LAYER_WIDTHS)
@pytest.mark.parametrize("rows", [1, 7, 9, 16, 17, 64, 130])  # both block widths, tails, several 64-row passes
def test_panel_linear_is_x_times_the_concatenated_weights_plus_bias(rows, widths):
    k, n = 40, sum(widths)
    weights = [randn(width, k, seed=width) for width in widths]
    bias, x = randn(n, seed=3), randn(rows, k, seed=4)
    panels = KERNELS.pack_panels(weights)
    expected = x.double() @ torch.cat(weights).double().T + bias.double()
    torch.testing.assert_close(KERNELS.panel_linear(x, panels, n, bias).double(), expected, rtol=1e-5, atol=1e-5)
    without_bias = KERNELS.panel_linear(x, panels, n, None).double()
    torch.testing.assert_close(without_bias, expected - bias.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [25, 30, 33, 36])  # panels of 3 (AVX2) or 12 (AVX512): pairs and a last one, cut short
def test_a_few_rows_get_the_products_of_a_full_block_bit_for_bit(n):
    """Up to 8 rows (a decode's last requests) take other code than 16 do (AVX512: a row's features in one vector;
    AVX2: half a block), and each output is still one chain of multiply-adds over k in order: a row's outputs are
    the same whichever rows come with it."""
    k = 96
    weight, bias, x = randn(n, k, seed=n), randn(n, seed=1), randn(16, k, seed=2)
    panels = KERNELS.pack_panels([weight])
    full, full_without_bias = KERNELS.panel_linear(x, panels, n, bias), KERNELS.panel_linear(x, panels, n, None)
    torch.testing.assert_close(full.double(), x.double() @ weight.double().T + bias.double(), rtol=1e-5, atol=1e-5)
    for rows in range(1, 9):
        assert torch.equal(KERNELS.panel_linear(x[:rows], panels, n, bias), full[:rows]), rows
        assert torch.equal(KERNELS.panel_linear(x[16 - rows:], panels, n, None), full_without_bias[16 - rows:]), rows


def test_panel_linear_writes_into_the_given_output():
    weight, x = randn(25, 40), randn(7, 40, seed=1)
    out = torch.full((7, 25), float("nan"))
    assert KERNELS.panel_linear(x, KERNELS.pack_panels([weight]), 25, None, out) is out
    torch.testing.assert_close(out.double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous torch.float32"):  # the C code would write past it
        KERNELS.panel_linear(x, KERNELS.pack_panels([weight]), 25, None, torch.empty(6, 25))


def test_panel_linear_keeps_leading_dims_and_runs_threaded():
    # [2, 40, 576] rows, 1536 outputs: the OpenMP branch; a strided input is read through a contiguous copy.
    weight, x = randn(1536, 576, scale=0.05), randn(2, 576, 40, seed=1).transpose(1, 2)
    out = KERNELS.panel_linear(x, KERNELS.pack_panels([weight]), 1536, None)
    assert out.shape == (2, 40, 1536)
    torch.testing.assert_close(out.double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-5)


def test_the_avx512_and_avx2_builds_give_the_same_products(avx2_kernels):
    """With AVX512 the panels are twelve features wide and the products 16 lanes wide (for up to 4 rows, a row's
    twelve features in one vector); each output is still one chain of multiply-adds over k in order, so the results
    are the AVX2 build's, bit for bit."""
    avx2 = avx2_kernels
    assert (avx2.panel_rows, KERNELS.panel_rows) == (3, 12)
    for widths in LAYER_WIDTHS:
        weights, n = [randn(width, 96, seed=width) for width in widths], sum(widths)
        for rows in (1, 2, 3, 4, 5, 7, 9, 16, 17, 64, 130):  # up to 4: AVX512's few-rows product
            x, bias = randn(rows, 96, seed=rows), randn(n, seed=1)
            assert torch.equal(avx2.panel_linear(x, avx2.pack_panels(weights), n, bias),
                               KERNELS.panel_linear(x, KERNELS.pack_panels(weights), n, bias)), (widths, rows)


needs_bf16_panels = pytest.mark.skipif(
    KERNELS is None or not KERNELS.bf16_panel_rows, reason="bf16 panels are built for CPUs with AVX512-BF16"
)


def assert_bf16_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """bf16 x, weight and bias: their products are exact in float32, so a float32 sum is within
    k 2^-24 sum|x w| of the float64 one, and one rounding to bf16 adds at most 2^-8 of the result."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = x.shape[-1] * 2**-24 * magnitude + 2**-8 * exact.abs() + 1e-30
    error = (out.double() - exact).abs()
    assert out.dtype == torch.bfloat16 and (error <= bound).all(), f"worst excess: {float((error - bound).max())}"
    # oneDNN's bf16 linear sums the same exact products in float32, in its own order: nearly always the same bf16
    same = (out == F.linear(x, weight, bias)).float().mean()
    assert same > 0.99, f"only {float(same):.1%} equal to torch's bf16 linear"


@needs_bf16_panels
@pytest.mark.parametrize("k", [40, 41])  # an odd k ends in half a pair
@pytest.mark.parametrize("widths", LAYER_WIDTHS)
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 130])  # a partial block, tails, several 64-row passes
def test_bf16_panel_linear_sums_the_exact_products_in_float32_and_rounds_once(rows, widths, k):
    n = sum(widths)
    weights = [randn(width, k, seed=width).bfloat16() for width in widths]
    bias, x = randn(n, seed=3).bfloat16(), randn(rows, k, seed=4).bfloat16()
    panels = KERNELS.pack_panels(weights)
    assert panels.dtype == torch.bfloat16
    assert_bf16_product(KERNELS.panel_linear(x, panels, n, bias), x, torch.cat(weights), bias)
    assert_bf16_product(KERNELS.panel_linear(x, panels, n, None), x, torch.cat(weights), None)


@needs_bf16_panels
def test_bf16_panel_linear_for_every_count_of_rows_a_block_can_hold():
    """Each count of rows up to a block's 16 runs its own unrolled loop: a decode step's last requests
    take them all; a block after a full one, and a feature panel cut short by n, too."""
    k, n = 41, 37
    weight, bias = randn(n, k, seed=1).bfloat16(), randn(n, seed=2).bfloat16()
    panels = KERNELS.pack_panels([weight])
    for rows in list(range(1, 17)) + [16 + 5, 64 + 16 + 3]:
        x = randn(rows, k, seed=rows).bfloat16()
        assert_bf16_product(KERNELS.panel_linear(x, panels, n, bias), x, weight, bias)


@pytest.mark.parametrize(
    "dtype, k", [(torch.float32, 40), pytest.param(torch.bfloat16, 41, marks=needs_bf16_panels)]
)
def test_rows_written_one_layer_at_a_time_multiply_and_read_back_as_the_weights(dtype, k):
    """The engine writes each layer's new weight straight into the panels (`pack_rows`, in any order)
    and reads them back (`unpack_rows`) instead of keeping a plain copy."""
    widths = LAYER_WIDTHS[1]
    weights = [randn(width, k, seed=width).to(dtype) for width in widths]
    firsts = [sum(widths[:i]) for i in range(len(widths))]
    panels = KERNELS.empty_panels(sum(widths), k, dtype)
    for i in reversed(range(len(widths))):  # the last layer first: no layer relies on another's write
        KERNELS.pack_rows(panels, weights[i].float(), firsts[i])  # converted to the panels' dtype
    assert torch.equal(panels, KERNELS.pack_panels(weights))
    for weight, first in zip(weights, firsts):
        assert torch.equal(KERNELS.unpack_rows(panels, first, len(weight), k), weight)
    x = randn(9, k, seed=4).to(dtype)
    expected = x.double() @ torch.cat(weights).double().T
    torch.testing.assert_close(KERNELS.panel_linear(x, panels, sum(widths), None).double(), expected,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@needs_bf16_panels
def test_bf16_panel_linear_keeps_leading_dims_runs_threaded_and_checks_its_output():
    # [2, 40, 576] rows, 1536 outputs: the OpenMP branch; a strided input is read through a contiguous copy.
    weight, x = randn(1536, 576, scale=0.05).bfloat16(), randn(2, 576, 40, seed=1).bfloat16().transpose(1, 2)
    panels = KERNELS.pack_panels([weight])
    out = torch.empty(2, 40, 1536, dtype=torch.bfloat16)
    assert KERNELS.panel_linear(x, panels, 1536, None, out) is out
    assert_bf16_product(out, x, weight, None)
    with pytest.raises(ValueError, match="contiguous torch.bfloat16"):
        KERNELS.panel_linear(x, panels, 1536, None, torch.empty(2, 40, 1536))
    with pytest.raises(TypeError, match="must be torch.bfloat16"):
        KERNELS.panel_linear(x.float(), panels, 1536, None)
    with pytest.raises(TypeError, match="float32 weights, or bf16"):
        KERNELS.pack_panels([weight.half()])


def test_bf16_layers_take_the_panels_only_without_amx(monkeypatch):
    """With AMX oneDNN's bf16 products run on its tiles, which the panels do not use: bf16 layers stay on
    oneDNN there; float32 layers take the panels everywhere."""
    linear = torch.nn.Linear(8, 4)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert packed_linear.panel_kernels_for(linear.bfloat16()) is None
    assert packed_linear.panel_kernels_for(linear.float()) is KERNELS
    if KERNELS.bf16_panel_rows:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert packed_linear.panel_kernels_for(linear.bfloat16()) is KERNELS


def assert_drawn_at(tokens: torch.Tensor, logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor):
    """Each token's interval of the float64 CDF of softmax(logits / T) holds its uniform draw (to rounding)."""
    cdf = torch.softmax(logits.double() / temperatures.double()[:, None], -1).cumsum(-1)
    upper = cdf.gather(1, tokens[:, None])[:, 0]
    lower = torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp_min(0)[:, None])[:, 0], 0.0)
    assert ((lower <= uniform.double() + 1e-6) & (uniform.double() < upper + 1e-6)).all(), (lower, uniform, upper)


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 49152])  # 4 x 1000 runs on one thread; 49152 a model's, threaded
def test_sample_rows_draws_the_inverse_cdf_of_the_tempered_softmax(dtype, vocab, build, request):
    kernels = request.getfixturevalue("avx2_kernels") if build == "avx2" else KERNELS
    rows = 4 if vocab == 1000 else 24
    logits = randn(rows, vocab, scale=4.0).to(dtype)
    logits[0, :vocab // 2] = float("-inf")  # masked tokens: never drawn
    logits[1, 7] = 60.0  # one token holds nearly all of the row
    temperatures = torch.tensor([0.6, 1.0, 1.3, 1.0] * (rows // 4))
    uniform = torch.rand(rows, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    logits[2, :3] = float("-inf")
    uniform[2] = 0.0  # the first token of weight > 0
    logits[3, 512:] = float("-inf")  # later blocks hold nothing: a draw at 1 walks back to the last token of weight
    uniform[3] = 1.0
    tokens, logprobs = kernels.sample_rows(logits, temperatures, uniform)
    assert_drawn_at(tokens, logits, temperatures, uniform)
    assert tokens[0] >= vocab // 2 and tokens[1] == 7 and tokens[2] == 3 and tokens[3] == 511
    expected = torch.log_softmax(logits.double() / temperatures.double()[:, None], -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_rows_says_nan_where_the_logits_have_none_to_give(dtype):
    """A NaN logit or a row of -inf ones (a broken model's) gives a NaN log-probability, as softmax would, and a
    token inside the vocabulary (a NaN logit's row: drawn from its other tokens); the other rows draw as ever."""
    logits = randn(3, 1000, scale=2.0).to(dtype)
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    tokens, logprobs = KERNELS.sample_rows(logits, torch.ones(3), torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64))
    assert logprobs[:2].isnan().all() and logprobs[2].isfinite() and ((tokens >= 0) & (tokens < 1000)).all()
    without_nan = logits[[0, 2]].clone()
    without_nan[0, 5] = float("-inf")  # the NaN's token has no weight; the others draw as ever
    assert_drawn_at(tokens[[0, 2]], without_nan, torch.ones(2), torch.tensor([0.5, 0.5]))


def test_the_engine_samples_through_the_kernel_only_where_it_draws_the_same(monkeypatch):
    """`sample_next_tokens` hands a batch to the C sampler only when no row is greedy, filtered or banned, and then
    draws the same tokens from the same generators as its torch ops (to the float32 CDF's rounding)."""
    from RL2.engine.embedded.sampling import SamplingParams, sample_next_tokens

    logits = randn(6, 5000, scale=3.0).to(torch.bfloat16)
    plain = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.0, 1.2, 1.0, 1.0)]
    seeded = [torch.Generator().manual_seed(11) if r == 3 else None for r in range(6)]

    def draw(params, banned=None, kernels=KERNELS):
        generator = torch.Generator().manual_seed(5)
        return sample_next_tokens(logits, params, banned or [[]] * 6, [g and g.clone_state() for g in seeded],
                                  default_generator=generator, kernels=kernels)

    calls = []
    monkeypatch.setattr(KERNELS, "sample_rows", lambda *a: calls.append(a) or DecodeKernels.sample_rows(KERNELS, *a))
    (tokens, logprobs), (torch_tokens, torch_logprobs) = draw(plain), draw(plain, kernels=None)
    assert len(calls) == 1
    uniform = calls[0][2]
    assert_drawn_at(tokens, logits, calls[0][1], uniform)
    assert torch.equal(tokens, torch_tokens)  # the torch ops drew at the same uniforms (none on an interval's edge)
    torch.testing.assert_close(logprobs, torch_logprobs, rtol=0, atol=2e-5)
    for first_row in (SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(min_p=0.1),
                      SamplingParams(temperature=0)):  # one filtered or greedy row: the torch ops draw the batch
        draw([first_row] + plain[1:])
    draw(plain, banned=[[3]] + [[]] * 5)  # a row that must not stop yet: the same
    assert len(calls) == 1
