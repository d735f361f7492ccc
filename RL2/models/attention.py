"""Varlen causal attention over packed sequences, registered with transformers as "rl2_varlen": the model's forward
passes `cu_seq_lens_q`, where each sequence starts, to every attention layer (kernels: `varlen_backend`, docs/gpus.md).
Keywords passed alike hand the row to `context_shard` (`.context_parallel`) or `shared_prefixes` (`.shared_prefix`)."""

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from RL2.utils.logging import log_rank0

ATTN_NAME = "rl2_varlen"
HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def flash_attn_varlen():
    """flash-attn's `flash_attn_varlen_func`, or None when flash-attn is not installed or does not load."""
    try:
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError):  # OSError: a build that does not match this torch or CUDA
        return None
    return flash_attn_varlen_func


@functools.cache
def torch_varlen_attention():
    """torch's `varlen_attn` where this torch has one we can call causally with a scale, else None. Its keywords
    changed between releases (`is_causal` became `window_size=(-1, 0)`, `enable_gqa` later): `_keywords` reads them."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = _keywords(varlen_attn)
    if "scale" not in params or not ({"window_size", "is_causal"} & params):
        return None
    return varlen_attn


@functools.cache
def _keywords(fn) -> frozenset[str]:
    """The parameter names of `fn`, read once (every attention call of every layer asks)."""
    return frozenset(inspect.signature(fn).parameters)


def flash_kernels_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether flash-attention kernels (flash-attn's, ring-flash-attn's, torch's) run here: CUDA, fp16/bf16, Ampere+."""
    return device.type == "cuda" and dtype in HALF_DTYPES and torch.cuda.get_device_capability(device)[0] >= 8


def varlen_backend(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel packed attention of a `dtype` query on `device` runs: "flash_attn", "torch_varlen" or "sdpa"."""
    if not flash_kernels_run(device, dtype):
        return "sdpa"
    if flash_attn_varlen() is not None:
        return "flash_attn"
    if torch_varlen_attention() is not None:
        return "torch_varlen"
    return "sdpa"


_LOGGED: set[tuple] = set()


def log_backend_once(kind: str, backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Say which attention kernel runs, the first time each (kind, kernel, device, dtype) is used."""
    key = (kind, backend, device.type, dtype)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log_rank0(f"{kind} attention: {backend} ({device.type}, {str(dtype).removeprefix('torch.')})")


def _flash_varlen(query, key, value, cu_seqlens, max_seqlen, scaling, softcap=None):
    # flash-attn takes (tokens, heads, head_dim) and handles grouped-query heads itself; it caps scores
    # from version 2.6 on, so the keyword goes only to models that need it.
    q, k, v = (x.squeeze(0).transpose(0, 1).contiguous() for x in (query, key, value))
    capped = {"softcap": softcap} if softcap else {}
    out = flash_attn_varlen()(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scaling,
                              causal=True, **capped)
    return out.unsqueeze(0)


def _torch_varlen(query, key, value, cu_seqlens, max_seqlen, scaling):
    varlen_attn = torch_varlen_attention()
    params = _keywords(varlen_attn)
    kwargs = {"scale": scaling}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal: no key after the query
    else:
        kwargs["is_causal"] = True
    if query.shape[1] != key.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # an older kernel wants one key/value head per query head; autograd sums the copies' gradients
            key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for x in (key, value))
    q, k, v = (x.squeeze(0).transpose(0, 1).contiguous() for x in (query, key, value))  # (tokens, heads, dim)
    cu_seqlens = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs).unsqueeze(0)


def sdpa_repeats_kv_heads(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, masked: bool) -> bool:
    """Whether SDPA gets grouped key/value heads repeated to the query's head count. On CUDA, SDPA's flash kernel takes
    grouped heads only in fp16/bf16 on Ampere+ without a mask; its memory-efficient kernel takes fp32 and masks but not
    grouped heads (torch's sdp_utils.cpp, `check_batch_size_and_num_heads_dense<false>`): else the math kernel."""
    if device.type != "cuda" or heads == kv_heads:
        return False
    return masked or not flash_kernels_run(device, dtype)


def sdpa(query, key, value, scaling, mask=None) -> torch.Tensor:
    """SDPA `[1, H, q, D]` x `[1, H_kv, k, D]` -> `[1, H, q, D]`: causal without `mask`, else under it. On
    CPU, bf16 and fp16 inputs are upcast: torch's CPU kernel runs faster in float32 and accumulates in it anyway."""
    upcast = not query.is_cuda and query.dtype in HALF_DTYPES
    q, k, v = (x.float() for x in (query, key, value)) if upcast else (query, key, value)
    k, v = repeat_kv_heads_for_sdpa(q, k, v, masked=mask is not None)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.to(query.dtype)


def repeat_kv_heads_for_sdpa(query, key, value, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """key and value `[B, H_kv, k, D]`, repeated to the query's H heads where `sdpa_repeats_kv_heads`
    says so (query head h reads key/value head h // (H / H_kv), as SDPA's `enable_gqa`); else as given."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if not sdpa_repeats_kv_heads(query.device, query.dtype, heads, kv_heads, masked):
        return key, value
    return key.repeat_interleave(heads // kv_heads, dim=1), value.repeat_interleave(heads // kv_heads, dim=1)


def softcap_of(config) -> float | None:
    """Gemma 2's attention-score cap (`attn_logit_softcapping`: scores -> cap * tanh(scores / cap)), else None."""
    return getattr(config, "attn_logit_softcapping", None) or None


def softcapped_attention(query, key, value, scaling: float, softcap: float, mask=None) -> torch.Tensor:
    """Capped scores (which SDPA and torch's varlen kernel cannot apply), in float32 as the model's eager attention.
    `mask`: True where a key is visible; None: causal, the queries being the last q of the k positions."""
    groups = query.shape[1] // key.shape[1]
    key, value = (x.float().repeat_interleave(groups, dim=1) for x in (key, value))
    scores = torch.matmul(query.float() * scaling, key.transpose(-1, -2))
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), value).to(query.dtype)


def sliding_window_of(config) -> int | None:
    """The attention window of a model's sliding-window layers (Mistral v0.1, Gemma 2/3, Qwen2/3 with
    use_sliding_window); None when every layer attends to the whole sequence."""
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None


def tokens_major_cat(outputs: list[torch.Tensor]) -> torch.Tensor:
    """SDPA outputs `[1, H, L_i, D]` of consecutive pieces of a row -> `[1, sum L_i, H, D]` (SDPA's: tokens-major)."""
    return torch.cat([out.transpose(1, 2) for out in outputs], dim=1)


def _per_sequence(attend, query, key, value, cu_seqlens):
    """`attend(q, k, v)` (causal, `[1, H, L, D]` each) on each packed sequence in turn -> `[1, T, H, D]`."""
    # One split per input: a split's backward is one concatenation; a slice's, a zero-filled row per slice.
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    pieces = zip(*(x.split(lengths, dim=2) for x in (query, key, value)))
    return tokens_major_cat([attend(q, k, v) for q, k, v in pieces])


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query `[1, H, T, D]`, key/value `[1, H_kv, T, D]` -> `[1, T, H, D]`."""
    context_shard = kwargs.get("context_shard")
    shared_prefixes = kwargs.get("shared_prefixes")
    softcap = kwargs.get("softcap")
    if softcap and (context_shard is not None or shared_prefixes is not None):
        # FSDPWorker refuses context parallelism and turns shared prefixes off for such models.
        raise NotImplementedError("capped attention scores (Gemma 2's attn_logit_softcapping) are computed "
                                  "only on whole packed rows: not under context parallelism or shared prefixes")
    if context_shard is not None:
        return context_shard.attention(query, key, value, scaling), None
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if shared_prefixes is not None:
        return shared_prefixes.attention(query, key, value, scaling), None
    if query.shape[2] != key.shape[2]:
        raise RuntimeError(f"{ATTN_NAME} is for packed training and scoring; generate with attn_implementation='sdpa'")
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:  # one sequence: the whole row
        cu_seqlens = torch.tensor([0, query.shape[2]], dtype=torch.int32, device=query.device)
    backend = varlen_backend(query.device, query.dtype)
    if softcap and backend != "flash_attn":  # flash-attn caps scores itself; SDPA and torch's kernel cannot
        backend = "softcapped"
    log_backend_once("packed", backend, query.device, query.dtype)
    if backend in ("softcapped", "sdpa"):
        attend = functools.partial(softcapped_attention, softcap=softcap) if softcap else sdpa
        return _per_sequence(functools.partial(attend, scaling=scaling), query, key, value, cu_seqlens), None
    max_seqlen = kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if backend == "flash_attn":
        return _flash_varlen(query, key, value, cu_seqlens, max_seqlen, scaling, softcap), None
    return _torch_varlen(query, key, value, cu_seqlens, max_seqlen, scaling), None


AttentionInterface.register(ATTN_NAME, varlen_attention)
