"""Log-probabilities of the labels and entropies from logits, a chunk of rows at a time in the CPU's cache rather than
a `[tokens, vocabulary]` float32 copy streamed through memory at every pass; -inf logits count as probability 0. On
CUDA, where Triton imports, `RL2.models.triton_logps` does the same (`RL2_TRITON_LOGPS=0` keeps this path)."""

import functools

import torch

from RL2.native import switches
from RL2.utils.logging import log_rank0

# float32 elements per chunk on CPU: 1 MB, so that a chunk and the temporaries of its passes stay in a
# core's L2 cache (`benchmarks/bench_logps.py`).
CHUNK_ELEMENTS = 1 << 18
# On a GPU the gain is memory (no float32 copy of all logits), and small chunks would cost kernel launches.
CUDA_CHUNK_ELEMENTS = 1 << 26


class LogpsAndEntropy(torch.autograd.Function):
    """`(log p(labels), entropy)` of `softmax(logits / temperature)`, float32, for float logits `[N, V]`; the entropy
    is zeros unless `with_entropy`. `overwrite_logits`: backward writes the gradient over the logits, not into a new
    `[N, V]` tensor (a small model's largest on CPU), as the caller promises nothing reads the logits afterwards."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool, temperature: float,
                overwrite_logits: bool = False):
        kernels = cuda_kernels() if logits.is_cuda else None
        ctx.kernels, ctx.with_entropy, ctx.temperature = kernels, with_entropy, temperature
        ctx.overwrite_logits = overwrite_logits
        # An output the loss does not use (the entropy as a metric) gets None in backward, not zeros that
        # would cost a [tokens, vocabulary] pass to multiply by.
        ctx.set_materialize_grads(False)
        if kernels is not None:
            logits, labels = logits.contiguous(), labels.contiguous()  # the kernels read label i at labels + i
            logps, lse, entropy = kernels.forward(logits, labels, temperature)
            if not with_entropy:
                entropy.zero_()
            ctx.save_for_backward(logits, labels, lse, entropy)
            return logps, entropy
        logps = logits.new_empty(logits.shape[0], dtype=torch.float32)
        entropy, lse = torch.zeros_like(logps), torch.empty_like(logps)
        for rows in _chunks(logits):
            # One exp per logit serves the log-sum-exp and the entropy: with s = z - max and S = sum e^s,
            # log p = s - log S and H = log S - sum(e^s s) / S.
            chunk = scaled(logits[rows], temperature)
            top = chunk.amax(-1, keepdim=True)
            top.masked_fill_(top.isinf(), 0.0)  # a row of -inf (or +inf) logits: as logsumexp treats it
            shifted = (chunk - top).clamp_(min=torch.finfo(torch.float32).min)  # p log p is 0, not nan, at -inf
            exps = shifted.exp()
            sums = exps.sum(-1)
            log_sum = sums.log()
            lse[rows] = top[:, 0] + log_sum
            logps[rows] = (chunk.gather(-1, labels[rows, None]) - top)[:, 0] - log_sum  # -inf stays -inf
            if with_entropy:
                entropy[rows] = log_sum - exps.mul_(shifted).sum(-1) / sums
        ctx.save_for_backward(logits, labels, lse, entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        """d log p_y / dz_j = [j = y] - p_j;  d H / dz_j = -p_j (log p_j + H)."""
        logits, labels, lse, entropy = ctx.saved_tensors
        grad_logps = torch.zeros_like(lse) if grad_logps is None else grad_logps
        if ctx.kernels is not None:
            grad_entropy = grad_entropy if ctx.with_entropy else None
            return ctx.kernels.backward(logits, labels, lse, entropy, grad_logps, grad_entropy, ctx.temperature), \
                None, None, None, None
        # Each chunk's gradient is computed in a tensor of its own, then stored over its logits (not read again).
        grad = logits if ctx.overwrite_logits else torch.empty_like(logits)
        floor = torch.finfo(torch.float32).min  # for -inf logits: p log p is then 0, not nan
        for rows in _chunks(logits):
            log_probs = (scaled(logits[rows], ctx.temperature) - lse[rows, None]).clamp_(min=floor)
            scale = grad_logps[rows, None]
            if grad_entropy is not None and ctx.with_entropy:
                scale = scale + grad_entropy[rows, None] * (log_probs + entropy[rows, None])
            chunk = log_probs.exp_().mul_(scale.neg())  # the [rows, 1] scale negated, not the chunk
            chunk.scatter_add_(-1, labels[rows, None], grad_logps[rows, None])
            grad[rows] = chunk / ctx.temperature if ctx.temperature != 1.0 else chunk
        return grad, None, None, None, None


@functools.cache
def cuda_kernels():
    """`RL2.models.triton_logps`, or None where Triton does not import or `RL2_TRITON_LOGPS=0`."""
    if not switches.triton_logps():
        return None
    try:
        from RL2.models import triton_logps
    except ImportError:
        log_rank0("log-probs on CUDA: chunked torch ops (Triton does not import)")
        return None
    log_rank0("log-probs on CUDA: Triton kernels")
    return triton_logps


def logps_and_entropy(logits: torch.Tensor, labels: torch.Tensor, overwrite_logits: bool = False,
                      temperature: float = 1.0, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits `[..., V]` and labels `[...]`: log p(labels) and the entropy (zeros unless `with_entropy`)
    of softmax(logits / temperature), both float32 `[...]`. `overwrite_logits`: see `LogpsAndEntropy`."""
    logps, entropy = LogpsAndEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), with_entropy,
                                           temperature, overwrite_logits)
    return logps.view(labels.shape), entropy.view(labels.shape)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The entropy of softmax(logits / temperature), float32 `[...]`, for logits `[..., V]`."""
    labels = logits.new_zeros(logits.shape[:-1], dtype=torch.long)  # any label: only the entropy is read
    return logps_and_entropy(logits, labels, temperature=temperature)[1]


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                overwrite_logits: bool = False) -> torch.Tensor:
    """log p(labels) under softmax(logits / temperature), float32 `[...]`; `overwrite_logits`: see `LogpsAndEntropy`."""
    return logps_and_entropy(logits, labels, overwrite_logits, temperature, with_entropy=False)[0]


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32."""
    chunk = logits.float()
    return chunk / temperature if temperature != 1.0 else chunk


def _chunks(logits: torch.Tensor):
    elements = CUDA_CHUNK_ELEMENTS if logits.is_cuda else CHUNK_ELEMENTS
    step = max(1, elements // logits.shape[-1])
    return (slice(start, start + step) for start in range(0, logits.shape[0], step))
