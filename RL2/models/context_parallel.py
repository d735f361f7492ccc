"""Context parallelism for packed sequences: cp ranks split the tokens of one row, zigzag (docs/parallelism.md).
Attention (`context_parallel_backend`): ring-flash-attn passes K/V around the ring on CUDA; else one all-gather of
K/V (the llama3 scheme). Per-token results are all-gathered back: callers see whole `[1, T]` rows on every cp rank."""

import functools
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from RL2.models.attention import flash_attn_varlen, flash_kernels_run, log_backend_once, repeat_kv_heads_for_sdpa


class _AllGatherSharded(torch.autograd.Function):
    """Concatenate every rank's tensor along dim 0 in rank order. Backward: sum the gradients over ranks,
    keep ours (every rank's attention reads every rank's K/V)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        if grad.is_cuda:
            out = torch.empty_like(grad.chunk(size)[rank])
            dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
            return out, None
        grad = grad.contiguous().clone()  # gloo has no reduce-scatter: all-reduce, then keep our part
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(size)[rank].clone(), None


class _AllGatherReplicated(_AllGatherSharded):
    """Concatenate every rank's tensor along dim 0. Backward: keep our part of the gradient (for per-token
    outputs of a loss every cp rank computes alike from the gathered row: our copy holds its gradient)."""

    @staticmethod
    def backward(ctx, grad):
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(size)[rank].contiguous(), None


@dataclass
class ContextShard:
    """How one packed row is split over the cp ranks, from this rank's point of view."""

    group: dist.ProcessGroup  # the cp group, and this rank's place in it
    rank: int
    size: int
    rows: torch.Tensor  # `[size, t]` position in the packed row of each rank's local token, -1 for padding
    positions: torch.Tensor  # `[t]` position within its sequence of each local token (padding continues past the end)
    cu_seqlens: torch.Tensor  # int32 local cumulative lengths: sequence i holds its two chunks, `2 * chunk_i` tokens
    chunks: list[int]  # chunk length of each sequence

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, group: dist.ProcessGroup) -> "ContextShard":
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        rows, positions, chunks = zigzag_layout(cu_seqlens.tolist(), size)
        device = cu_seqlens.device
        local_lens = torch.tensor([2 * c for c in chunks], dtype=torch.int32, device=device)
        return cls(group, rank, size, torch.tensor(rows, dtype=torch.long, device=device),
                   torch.tensor(positions[rank], dtype=torch.long, device=device),
                   F.pad(local_lens.cumsum(0, dtype=torch.int32), (1, 0)), chunks)

    @property
    def local_rows(self) -> torch.Tensor:
        return self.rows[self.rank]

    def shard(self, row: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a `[1, T]` row (0 at padding slots)."""
        index = self.local_rows
        return row[:, index.clamp(min=0)].masked_fill((index < 0).unsqueeze(0), 0)

    def gather(self, local: torch.Tensor, total: int) -> torch.Tensor:
        """Per-token `[1, t]` values of every rank -> the `[1, T]` packed row (padding dropped)."""
        gathered = _AllGatherReplicated.apply(local.squeeze(0), self.group)  # [size * t]
        rows = self.rows.flatten()
        keep = rows >= 0
        return gathered.new_zeros(total).index_copy(0, rows[keep], gathered[keep]).unsqueeze(0)

    def attention(self, query, key, value, scaling):
        """Causal attention of the local queries over whole sequences. `[1, H, t, D]` -> `[1, t, H, D]`."""
        backend = context_parallel_backend(query.device, query.dtype)
        log_backend_once("context-parallel", backend, query.device, query.dtype)
        if backend == "ring_flash_attn":
            return _ring_flash(query, key, value, self, scaling)
        return _gathered_kv_attention(query, key, value, self, scaling)


def context_parallel_backend(device: torch.device, dtype: torch.dtype) -> str:
    """"ring_flash_attn" where flash kernels run and ring-flash-attn and flash-attn load, else "all_gather_kv"."""
    if flash_kernels_run(device, dtype) and flash_attn_varlen() is not None and _ring_flash_attn_module():
        return "ring_flash_attn"
    return "all_gather_kv"


def zigzag_layout(bounds: list[int], size: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Split the sequences of a packed row (cumulative lengths `bounds`) over `size` ranks, zigzag. Returns rows[r][k]
    (position in the row of rank r's k-th local token, -1 for padding), positions[r][k] (its position within its
    sequence) and chunks[i] (the chunk length of sequence i; each rank holds 2 chunks of every sequence)."""
    rows, positions, chunks = [[] for _ in range(size)], [[] for _ in range(size)], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        chunk = -(-length // (2 * size))
        chunks.append(chunk)
        for r in range(size):
            for c in (r, 2 * size - 1 - r):
                for p in range(c * chunk, (c + 1) * chunk):
                    rows[r].append(start + p if p < length else -1)
                    positions[r].append(p)
    return rows, positions, chunks


def _gathered_kv_attention(query, key, value, shard: ContextShard, scaling):
    """Exact torch path: all-gather K/V, then each local chunk pair attends to its whole sequence."""
    t = query.shape[2]
    # [1, Hkv, t, D] -> [size * t, Hkv, D]: every rank's local tokens, rank after rank.
    kv = [_AllGatherSharded.apply(x.squeeze(0).transpose(0, 1), shard.group) for x in (key, value)]
    outputs = []
    local_bounds = shard.cu_seqlens.tolist()
    for i, chunk in enumerate(shard.chunks):
        start, end = local_bounds[i], local_bounds[i + 1]
        # The padded sequence in order: chunk c sits on rank min(c, 2*size-1-c), first or second of its pair.
        order = []
        for c in range(2 * shard.size):
            owner = min(c, 2 * shard.size - 1 - c)
            offset = owner * t + start + (0 if c == owner else chunk)
            order.extend(range(offset, offset + chunk))
        order = torch.tensor(order, device=query.device)
        k, v = (x[order].transpose(0, 1).unsqueeze(0) for x in kv)  # [1, Hkv, P, D]
        q_pos = shard.positions[start:end]
        mask = torch.arange(k.shape[2], device=query.device).unsqueeze(0) <= q_pos.unsqueeze(1)
        # With the mask, grouped heads would take SDPA's math kernel on CUDA (`[H, t, P]` scores).
        k, v = repeat_kv_heads_for_sdpa(query, k, v, masked=True)
        outputs.append(F.scaled_dot_product_attention(query[:, :, start:end], k, v, attn_mask=mask, scale=scaling,
                                                      enable_gqa=query.shape[1] != k.shape[1]))
    return torch.cat(outputs, dim=2).transpose(1, 2)


def _ring_flash(query, key, value, shard: ContextShard, scaling):
    q, k, v = (x.squeeze(0).transpose(0, 1).contiguous() for x in (query, key, value))  # (tokens, heads, head_dim)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = _ring_flash_attn_module().zigzag_ring_flash_attn_varlen_func(
        q, k, v, shard.cu_seqlens, 2 * max(shard.chunks), softmax_scale=scaling, causal=True, group=shard.group)
    return out.unsqueeze(0)


@functools.cache
def _ring_flash_attn_module():
    """`ring_flash_attn.zigzag_ring_flash_attn_varlen`, or None. The package `__init__` imports its HF adapter, which
    fails on transformers 5.x: an empty package object at the same folder lets the submodule load on its own."""
    name = "ring_flash_attn.zigzag_ring_flash_attn_varlen"
    try:
        return importlib.import_module(name)
    except ImportError:
        spec = importlib.util.find_spec("ring_flash_attn")
        if spec is None:
            return None
        for key in [k for k in sys.modules if k == "ring_flash_attn" or k.startswith("ring_flash_attn.")]:
            del sys.modules[key]
        package = types.ModuleType("ring_flash_attn")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["ring_flash_attn"] = package
        try:
            return importlib.import_module(name)
        except (ImportError, OSError):  # e.g. its flash-attn import fails
            return None
