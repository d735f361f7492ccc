"""The embedded engine's own forward for Llama-family decoders (docs/cpu.md): with a few dozen rows per decode step,
HF's modules spend much of it in Python and small ops around the matmuls. Prefill runs through it too (attention by
SDPA), so the fused weights are the only packed copy. The arithmetic is HF's: RMSNorm in float32, the rotary embedding
in the model's dtype with cos/sin from the model's own rotary module (every RoPE scaling HF implements applies), and
for one new token attention scores and softmax in float32, as SDPA's kernels compute them."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from RL2.native.decode_kernels import SUFFIXES, DecodeKernels, load_decode_kernels

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Applies linear layers that share an input, outputs concatenated, as `PackedLinear.__call__`; has `out_features`.
LinearKernel = Callable[..., torch.Tensor]


def llama_forward_supported(model: torch.nn.Module) -> bool:
    """Whether `LlamaForward` computes what the model's own forward computes, for this model."""
    config = model.config
    return config.model_type in FAMILIES and config.hidden_act == "silu" and getattr(config, "pretraining_tp", 1) == 1


def attention_bias(visible: torch.Tensor) -> torch.Tensor:
    """Boolean `[rows, L]` -> float32 0 / -inf to add to the scores; one per step, for every layer."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def attend_one_token(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of one query per row (`[rows, H, D]`, the output's shape and dtype) over its cached keys and values
    (`SlotKVCache`: keys `[rows, H_kv, L, D]`, values in the model's dtype), with `bias` `[rows, L]` from
    `attention_bias`; scores and softmax in float32, the probabilities meeting the values in their dtype, as in SDPA's
    kernels, whose CPU one spends most of its time on blocking and masking for one query, which plain products skip."""
    rows, heads, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim).to(keys.dtype)
    scores = torch.matmul(grouped * scale, keys.transpose(-1, -2)).add_(bias.view(rows, 1, 1, length))
    out = torch.matmul(scores.softmax(-1).to(values.dtype), values)
    return out.view(rows, heads, dim).to(query.dtype)


@dataclass
class _Layer:
    input_norm: torch.nn.Module
    qkv: LinearKernel
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    o: LinearKernel
    post_norm: torch.nn.Module
    gate_up: LinearKernel
    down: LinearKernel
    scale: float


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, with rotate_half(x) * sin = roll(x) * [-sin, sin]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class LlamaForward:
    """Forwards of a Llama-family decoder over the engine's `SlotKVCache`; `kernel` maps `nn.Linear`s sharing an input
    to the callable applying them all. A float32 or bf16 model on CPU decodes through the C kernels where they can be
    built; everything else (GPU, prefill, other dtypes) through the torch ops below, which compute the same."""

    def __init__(self, model: torch.nn.Module, kernel: Callable[[list[torch.nn.Linear]], LinearKernel]):
        decoder = model.get_decoder()
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        weight = self.embed.weight
        kernels_apply = weight.device.type == "cpu" and weight.dtype in SUFFIXES
        self.decode_kernels: DecodeKernels | None = load_decode_kernels() if kernels_apply else None
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm,
                qkv=kernel([attn.q_proj, attn.k_proj, attn.v_proj]),
                q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
                o=kernel([attn.o_proj]),
                post_norm=layer.post_attention_layernorm,
                gate_up=kernel([mlp.gate_proj, mlp.up_proj]),
                down=kernel([mlp.down_proj]),
                scale=attn.scaling,
            ))

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """One token per row: input_ids, positions `[rows]` (row r sees positions 0..positions[r]);
        `cache` bound by `bind_decode`. Returns the final hidden states `[rows, hidden]`."""
        if self.decode_kernels is not None:
            return self._decode_with_kernels(input_ids, positions, cache)
        length = int(positions.max()) + 1
        bias = attention_bias(torch.arange(length, device=positions.device)[None, :] <= positions[:, None])

        def attend(q, keys, values, scale):
            return attend_one_token(q[:, 0], keys, values, bias, scale)[:, None]

        return _rms_norm(self._layers(input_ids[:, None], positions[:, None], cache, attend)[:, 0], self.norm)

    def _decode_with_kernels(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """`decode` with the matmuls here and the rest of each layer in four C calls."""
        kernels, rows = self.decode_kernels, len(input_ids)
        hidden = self.embed(input_ids)  # a fresh tensor: the residual adds go into it in place
        cos, sin = (t[:, 0].contiguous() for t in self.rotary(hidden, positions[:, None]))
        normed = torch.empty_like(hidden)
        q = hidden.new_empty(rows, self.heads, self.head_dim, dtype=torch.float32)  # what the attention reads
        attended, activated = hidden.new_empty(rows, self.heads * self.head_dim), None
        new_layer = hidden.new_empty(0, self.kv_heads, 1, self.head_dim)  # what a new layer's cache holds
        # Each product's output is read before the next runs: all layers share one buffer per output width.
        products: dict[int, torch.Tensor] = {}

        def product(linear, x: torch.Tensor) -> torch.Tensor:
            width = linear.out_features
            if width not in products:
                products[width] = hidden.new_empty(rows, width)
            return linear(x, products[width])

        delta = None  # what the last sublayer adds to the residual stream
        for index, layer in enumerate(self.layers):
            kernels.add_rms_norm(hidden, delta, layer.input_norm.weight, layer.input_norm.variance_epsilon, normed)
            keys, values = cache.buffers(index, new_layer, new_layer)
            q_norm, k_norm, eps = None, None, 0.0
            if layer.q_norm is not None:  # Qwen3
                q_norm, k_norm, eps = layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.variance_epsilon
            qkv = product(layer.qkv, normed)
            kernels.rope_and_store(qkv, cos, sin, positions, q_norm, k_norm, eps, q, keys, values)
            kernels.decode_attention(q, keys, values, positions, layer.scale, attended, cache.row_groups)
            delta = product(layer.o, attended)
            kernels.add_rms_norm(hidden, delta, layer.post_norm.weight, layer.post_norm.variance_epsilon, normed)
            gate_up = product(layer.gate_up, normed)
            if activated is None:
                activated = gate_up.new_empty(rows, gate_up.shape[1] // 2)
            delta = product(layer.down, kernels.silu_mul(gate_up, activated))
        return kernels.add_rms_norm(hidden, delta, self.norm.weight, self.norm.variance_epsilon, normed)

    @torch.inference_mode()
    def extend(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor,
               keep: torch.Tensor | None) -> torch.Tensor | None:
        """A chunk per row (input_ids, positions `[rows, T]`, mask boolean `[rows, 1, T, L]`, `cache` bound by
        `bind_prefill`): the final hidden states `[rows, hidden]` at each one's `keep[row, 0]` (None without `keep`)."""
        def attend(q, keys, values, scale):
            return F.scaled_dot_product_attention(q.transpose(1, 2), keys.to(q.dtype), values, attn_mask=mask,
                                                  scale=scale, enable_gqa=self.heads != self.kv_heads).transpose(1, 2)

        hidden = self._layers(input_ids, positions, cache, attend)
        if keep is None:
            return None
        return _rms_norm(torch.take_along_dim(hidden, keep[..., None], dim=1)[:, 0], self.norm)

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, attend: Callable) -> torch.Tensor:
        """Hidden states `[rows, T, hidden]` after the last layer (before the final norm)."""
        rows, width = input_ids.shape
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, positions)  # [rows, T, D] in the model's dtype
        half = self.head_dim // 2
        cos, signed_sin = cos[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, :, None]
        for index, layer in enumerate(self.layers):
            x = _rms_norm(hidden, layer.input_norm)
            heads = layer.qkv(x).view(rows, width, self.heads + 2 * self.kv_heads, self.head_dim)
            qk, v = heads[:, :, : self.heads + self.kv_heads], heads[:, :, self.heads + self.kv_heads :]
            if layer.q_norm is not None:  # Qwen3: per-head RMSNorm before the rotation
                q, k = qk.split([self.heads, self.kv_heads], dim=2)
                qk = torch.cat([_rms_norm(q, layer.q_norm), _rms_norm(k, layer.k_norm)], dim=2)
            q, k = _rotate(qk, cos, signed_sin).split([self.heads, self.kv_heads], dim=2)  # q and k as one
            keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), index)
            attended = attend(q, keys, values, layer.scale)  # [rows, T, H, D]
            hidden = hidden + layer.o(attended.reshape(rows, width, -1))
            x = _rms_norm(hidden, layer.post_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return hidden
