"""The C decode kernels (`decode_kernels.c`), built once per machine (`RL2.native.build`) and called through
ctypes. Without a compiler (or with RL2_DECODE_KERNELS=0) the engine computes the same step with torch ops."""

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from RL2.native import switches
from RL2.native.build import FLOAT, INT, POINTER, SUFFIXES, load_library

SOURCE = Path(__file__).with_name("decode_kernels.c")
# The decode step's kernels, once per model dtype: their names end in the dtype's suffix.
STEP_KERNELS = {
    "add_rms_norm": [POINTER, POINTER, POINTER, POINTER, INT, INT, FLOAT],
    "silu_mul": [POINTER, POINTER, INT, INT],
    "rope_and_store": [POINTER] * 6 + [FLOAT] + [POINTER] * 3 + [INT] * 5,
    "decode_attention": [POINTER] * 5 + [INT] * 5 + [FLOAT] + [POINTER] * 3 + [INT],
    "sample_rows": [POINTER, INT, INT] + [POINTER] * 4,
}
SIGNATURES = {
    **{name + suffix: types for name, types in STEP_KERNELS.items() for suffix in SUFFIXES.values()},
    **{"pack_panels" + suffix: [POINTER, INT, INT, INT, POINTER] for suffix in ("", "_bf16")},
    **{"panel_linear" + suffix: [POINTER, INT, INT, POINTER, INT, POINTER, POINTER] for suffix in ("", "_bf16")},
    "panel_rows": [],
    "bf16_panel_rows": [],
}
RETURNS = {name: ctypes.c_int for name in ("panel_linear", "panel_linear_bf16", "panel_rows", "bf16_panel_rows")}


@functools.cache
def load_decode_kernels() -> "DecodeKernels | None":
    """The kernels, built if needed; None (with a warning saying why) where they cannot be built."""
    library = load_library(SOURCE, switches.decode_kernels(), "the embedded engine's decode runs on torch ops, slower",
                           SIGNATURES, RETURNS)
    return None if library is None else DecodeKernels(library)


@dataclass
class RowGroups:
    """Rows whose caches hold the same keys and values at their first positions (a GRPO group's responses), which
    decode attention reads once: group i's rows, `order[starts[i]:starts[i + 1]]`, share 0..shared[i]-1 (int64)."""

    order: torch.Tensor
    starts: torch.Tensor
    shared: torch.Tensor


def _check_cache(like: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    # The C code reads and writes the cache as elements of the model's dtype: any other would be garbage.
    if not keys.dtype == values.dtype == like.dtype:
        raise TypeError(f"the decode kernels take a cache in the model's dtype {like.dtype}: keys {keys.dtype}, "
                        f"values {values.dtype}")


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class DecodeKernels:
    """Typed calls into the library, which writes the outputs in place; tensors C-contiguous, as its source describes,
    in the model's dtype, float32 or bf16 (q float32; positions int64; bf16 panels only where `bf16_panel_rows`)."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library
        self.panel_rows = library.panel_rows()  # output features per panel: 12 where built with AVX512, else 3
        self.bf16_panel_rows = library.bf16_panel_rows()  # 16 (a vector) where built with AVX512-BF16, else 0: none
        self._step_kernels = {(name, dtype): getattr(library, name + suffix)
                              for name in STEP_KERNELS for dtype, suffix in SUFFIXES.items()}

    def _step_kernel(self, name: str, like: torch.Tensor):
        kernel = self._step_kernels.get((name, like.dtype))
        if kernel is None:
            raise TypeError(f"the decode kernels take float32 or bfloat16 models, not {like.dtype}")
        return kernel

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> torch.Tensor:
        """hidden += delta (skipped if None); out = RMSNorm(hidden) * weight."""
        rows, dim = hidden.shape
        self._step_kernel("add_rms_norm", hidden)(hidden.data_ptr(), _address(delta), weight.data_ptr(), out.data_ptr(),
                                                  rows, dim, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = silu(gate) * up for gate_up = [gate | up] along the last dim."""
        rows, width = out.shape
        self._step_kernel("silu_mul", gate_up)(gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out

    def rope_and_store(self, qkv, cos, sin, positions, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                       eps: float, q_out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q_out = rotated q; rotated k and v written into the cache at each row's position."""
        rows, heads, head_dim = q_out.shape
        _check_cache(qkv, keys, values)
        self._step_kernel("rope_and_store", qkv)(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), _address(q_norm), _address(k_norm),
            eps, q_out.data_ptr(), keys.data_ptr(), values.data_ptr(), rows, heads, keys.shape[1], head_dim,
            keys.shape[2])
        return q_out

    def decode_attention(self, q, keys, values, positions, scale: float, out: torch.Tensor,
                         groups: RowGroups | None = None) -> torch.Tensor:
        """out `[rows, heads * head_dim]` (the values' dtype) = attention of q `[rows, heads, head_dim]` (float32) over
        cache positions 0..positions[r] of each row: keys and values in the model's dtype, each a whole `[cache_rows,
        kv_heads, cache_len, head_dim]` cache buffer. With `groups`, a group's rows read their shared positions once."""
        rows, heads, head_dim = q.shape
        _check_cache(values, keys, values)
        order, starts, shared = (None, None, None) if groups is None else (groups.order, groups.starts, groups.shared)
        self._step_kernel("decode_attention", values)(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), positions.data_ptr(), out.data_ptr(), rows, heads,
            keys.shape[1], head_dim, keys.shape[2], scale, _address(order), _address(starts), _address(shared),
            0 if groups is None else len(shared))
        return out

    def sample_rows(self, logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64, logprobs float32) `[rows]`: row r's token drawn from softmax(logits[r] / temperatures[r]) by
        inverse CDF at uniform[r], and its log-probability at that temperature; logits `[rows, vocab]` in the model's
        dtype, temperatures float32, uniform float64."""
        logits = logits.contiguous()
        rows, vocab = logits.shape
        temperatures, uniform = temperatures.float().contiguous(), uniform.double().contiguous()
        tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
        self._step_kernel("sample_rows", logits)(logits.data_ptr(), rows, vocab, temperatures.data_ptr(),
                                                 uniform.data_ptr(), tokens.data_ptr(), logprobs.data_ptr())
        return tokens, logprobs

    def pack_panels(self, weights: list[torch.Tensor]) -> torch.Tensor:
        """Weights `[n_i, k]` (float32, or bf16 where `bf16_panel_rows`) of layers sharing an input, their
        outputs in this order, as the panels `panel_linear` reads, n = sum of n_i: float32
        `[ceil(n / panel_rows), k, panel_rows]`, bf16 `[ceil(n / w), ceil(k / 2), w, 2]` with w = `bf16_panel_rows`."""
        panels = self.empty_panels(sum(w.shape[0] for w in weights), weights[0].shape[1], weights[0].dtype)
        first = 0
        for weight in weights:
            self.pack_rows(panels, weight, first)
            first += weight.shape[0]
        return panels

    def empty_panels(self, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """Panels for n features of k inputs (`pack_panels`) for `pack_rows` to fill; those past n are zero (finite)."""
        if dtype == torch.bfloat16 and self.bf16_panel_rows:
            width = self.bf16_panel_rows
            panels = torch.empty(-(-n // width), -(-k // 2), width, 2, dtype=dtype)
        elif dtype == torch.float32:
            width = self.panel_rows
            panels = torch.empty(-(-n // width), k, width)
        else:
            raise TypeError(f"pack_panels: float32 weights, or bf16 on a CPU with AVX512-BF16; got {dtype}")
        panels[-1, :, n - width * (len(panels) - 1):] = 0.0
        return panels

    def pack_rows(self, panels: torch.Tensor, weight: torch.Tensor, first: int) -> None:
        """Write `weight` `[rows, k]` into features first..first+rows-1 of `panels` (`empty_panels`)."""
        pack = self.library.pack_panels_bf16 if panels.dtype == torch.bfloat16 else self.library.pack_panels
        weight = weight.detach().to(panels.dtype).contiguous()
        pack(weight.data_ptr(), weight.shape[0], weight.shape[1], first, panels.data_ptr())

    def unpack_rows(self, panels: torch.Tensor, first: int, rows: int, k: int) -> torch.Tensor:
        """The weight `[rows, k]` that `pack_rows` wrote at `first` (a copy)."""
        # float32 [panels, k, width] or bf16 [panels, k / 2, width, 2] -> [features, k]
        weights = panels.transpose(1, 2).reshape(panels.shape[0] * panels.shape[2], -1)
        return weights[first : first + rows, :k].clone()

    def panel_linear(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """x `[..., k]` times the packed weights (`pack_panels`) of n outputs, plus bias: `[..., n]`,
        written into `out` (contiguous, that shape) where given; x, bias and out in the panels' dtype."""
        k, dtype = x.shape[-1], panels.dtype
        if x.dtype != dtype or (bias is not None and bias.dtype != dtype):
            raise TypeError(f"panel_linear: x and bias must be {dtype} as the panels are, not {x.dtype}")
        rows = x.reshape(-1, k).contiguous()
        if out is None:
            out = x.new_empty(*x.shape[:-1], n)
        elif out.shape != (*x.shape[:-1], n) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"panel_linear: out must be a contiguous {dtype} {(*x.shape[:-1], n)}, "
                             f"not {out.dtype} {tuple(out.shape)}")
        product = self.library.panel_linear_bf16 if dtype == torch.bfloat16 else self.library.panel_linear
        if product(rows.data_ptr(), len(rows), k, panels.data_ptr(), n, _address(bias), out.data_ptr()):
            raise MemoryError(f"panel_linear: no memory for the {k} x 64 elements of its scratch")
        return out
