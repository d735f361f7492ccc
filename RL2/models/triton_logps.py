"""Log-probabilities of the labels and entropies of logits rows on CUDA, one Triton program per row: forward
reads each row once in its own dtype (a running maximum, the sum of exp and of exp times the logit), backward
once more to write the gradient; float32 math and the conventions of `RL2.models.chunked_logps`."""

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries a program holds at once
FLOAT32_MIN = tl.constexpr(-3.4028234663852886e38)  # a global a kernel reads must be a constexpr


@triton.jit
def _forward(logits_ptr, row_stride, labels_ptr, logps_ptr, lse_ptr, entropy_ptr, vocab, temperature,
             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    # Per lane: the running maximum, the sum of exp(z - maximum) and of exp(z - maximum) * z (finite z).
    lane_max = tl.full([BLOCK], -float("inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    lane_sum_z = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        z = tl.load(base + offsets, mask=offsets < vocab, other=-float("inf")).to(tl.float32) / temperature
        new_max = tl.maximum(lane_max, z)
        # While a lane has seen only -inf its maximum stays -inf: nothing to rescale, nothing added.
        rescale = tl.where(new_max == -float("inf"), 1.0, tl.exp(lane_max - new_max))
        finite = z > -float("inf")
        e = tl.where(finite, tl.exp(z - new_max), 0.0)
        lane_sum = lane_sum * rescale + e
        lane_sum_z = lane_sum_z * rescale + tl.where(finite, e * z, 0.0)
        lane_max = new_max
    row_max = tl.max(lane_max, 0)
    weight = tl.where(lane_max == -float("inf"), 0.0, tl.exp(lane_max - row_max))
    sum_exp = tl.sum(lane_sum * weight, 0)
    lse = row_max + tl.log(sum_exp)
    label = tl.load(labels_ptr + row)
    in_range = (label >= 0) & (label < vocab)  # an out-of-range label reads nan, as a visible error
    label_logit = tl.load(base + label, mask=in_range, other=float("nan")).to(tl.float32) / temperature
    tl.store(logps_ptr + row, label_logit - lse)
    tl.store(lse_ptr + row, lse)
    tl.store(entropy_ptr + row, lse - tl.sum(lane_sum_z * weight, 0) / sum_exp)  # H = lse - E_p[z]


@triton.jit
def _backward(logits_ptr, row_stride, grad_ptr, labels_ptr, lse_ptr, entropy_ptr, grad_logps_ptr,
              grad_entropy_ptr, vocab, temperature, WITH_ENTROPY_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """d log p_y / dz_j = [j = y] - p_j;  d H / dz_j = -p_j (log p_j + H); both divided by the temperature."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    lse = tl.load(lse_ptr + row)
    grad_logp = tl.load(grad_logps_ptr + row)
    label = tl.load(labels_ptr + row)
    if WITH_ENTROPY_GRAD:
        grad_entropy = tl.load(grad_entropy_ptr + row)
        entropy = tl.load(entropy_ptr + row)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < vocab
        z = tl.load(base + offsets, mask=inside, other=-float("inf")).to(tl.float32) / temperature
        log_p = tl.maximum(z - lse, FLOAT32_MIN)
        scale = grad_logp
        if WITH_ENTROPY_GRAD:
            scale = grad_logp + grad_entropy * (log_p + entropy)
        p = tl.exp(log_p)
        # A masked entry (p = 0) gets no gradient, however large the entropy term's factor.
        grad = tl.where(p > 0.0, -p * scale, 0.0) + tl.where(offsets == label, grad_logp, 0.0)
        tl.store(grad_ptr + row * row_stride + offsets, (grad / temperature).to(grad_ptr.dtype.element_ty),
                 mask=inside)


def forward(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    """`(log p(labels), log-sum-exp, entropy)` of `softmax(logits / temperature)`, float32 `[N]`, for CUDA
    logits `[N, V]` whose rows are contiguous."""
    n, vocab = logits.shape
    logps, lse, entropy = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    if n:
        _forward[(n,)](logits, logits.stride(0), labels, logps, lse, entropy, vocab, float(temperature),
                       BLOCK=BLOCK, num_warps=8)
    return logps, lse, entropy


def backward(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
             grad_logps: torch.Tensor, grad_entropy: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """The logits' gradient, in their dtype, of `grad_logps . log p(labels)` + (if given) `grad_entropy . entropy`."""
    n, vocab = logits.shape
    grad = torch.empty_like(logits)
    if n:
        with_entropy = grad_entropy is not None
        # Without an entropy gradient the kernel never reads its pointer: grad_logps stands in for it.
        _backward[(n,)](logits, logits.stride(0), grad, labels, lse, entropy, grad_logps.contiguous(),
                        grad_entropy.contiguous() if with_entropy else grad_logps, vocab, float(temperature),
                        WITH_ENTROPY_GRAD=with_entropy, BLOCK=BLOCK, num_warps=8)
    return grad
