"""Attention over a shared-prefix row on CPU as one C call per layer, forward and backward (`prefix_attention.c`), for
float32 and bfloat16, where it applies (`usable`); else `SharedPrefixRow.attention` makes SDPA calls."""

import ctypes
import functools
from pathlib import Path

import torch

from RL2.native import switches
from RL2.native.build import FLOAT, INT, POINTER, SUFFIXES, load_library

SOURCE = Path(__file__).with_name("prefix_attention.c")
SIGNATURES = {
    "prefix_attention_columns": [],
    "prefix_attention_forward": [POINTER] * 6 + [INT] * 4 + [FLOAT, ctypes.c_int],
    "prefix_attention_backward": [POINTER] * 9 + [INT] * 4 + [FLOAT, ctypes.c_int],
}
RETURNS = {name: ctypes.c_int for name in SIGNATURES}


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_library(SOURCE, switches.prefix_attention(), "shared-prefix attention runs as SDPA calls", SIGNATURES,
                        RETURNS)


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes these: plain CPU tensors of one dtype it has, a head size it divides."""
    tensors = (query, key, value)
    if not all(type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype == query.dtype for t in tensors):
        return False
    if query.dtype not in SUFFIXES or query.shape[1] % key.shape[1]:
        return False
    library = _library()
    return library is not None and query.shape[-1] % library.prefix_attention_columns() == 0


def prefix_attention(query, key, value, runs: torch.Tensor, scaling: float) -> torch.Tensor:
    """query `[1, H, T, D]`, key/value `[1, H_kv, T, D]` -> `[1, T, H, D]`. `runs` `[3, T]` int64: each
    token sees keys prefix_start..prefix_end - 1 and own_start..itself."""
    # Tokens-major, as the projections wrote them: for their usual layout these are views, not copies.
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    return _PrefixAttention.apply(q, k, v, runs, scaling).unsqueeze(0)


class _PrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, runs, scaling):
        tokens, heads, head_dim = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(tokens, heads, dtype=torch.float32)
        if _library().prefix_attention_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), runs.data_ptr(),
                                               out.data_ptr(), lse.data_ptr(), tokens, heads, k.shape[1], head_dim,
                                               scaling, q.dtype == torch.bfloat16):
            raise MemoryError("prefix attention: out of memory for its scratch buffers")
        ctx.save_for_backward(q, k, v, runs, lse)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, runs, lse = ctx.saved_tensors
        grad_out = grad_out.to(q.dtype).contiguous()
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        tokens, heads, head_dim = q.shape
        if _library().prefix_attention_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), runs.data_ptr(),
                                                lse.data_ptr(), grad_out.data_ptr(), grad_q.data_ptr(),
                                                grad_k.data_ptr(), grad_v.data_ptr(), tokens, heads, k.shape[1],
                                                head_dim, ctx.scaling, q.dtype == torch.bfloat16):
            raise MemoryError("prefix attention: out of memory for its scratch buffers")
        return grad_q, grad_k, grad_v, None, None
