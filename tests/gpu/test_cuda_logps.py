"""Log-probs and entropies on CUDA with a 150k vocabulary, through the Triton kernels and through the
chunked torch ops (`RL2_TRITON_LOGPS=0`): values, gradients, memory and time."""

import importlib.util

import pytest
import torch

from RL2.models import chunked_logps
from RL2.models.chunked_logps import logps_and_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, VOCAB = 2048, 151_936


@pytest.fixture(params=["triton", "chunked"])
def path(request, monkeypatch):
    if request.param == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("RL2_TRITON_LOGPS", "1" if request.param == "triton" else "0")
    chunked_logps.cuda_kernels.cache_clear()
    yield request.param
    chunked_logps.cuda_kernels.cache_clear()


def test_logps_with_a_150k_vocabulary(path):
    assert (chunked_logps.cuda_kernels() is not None) == (path == "triton")
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    logits = (4 * torch.randn(TOKENS, VOCAB, device=device, generator=generator)).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), device=device, generator=generator)
    weights = torch.randn(2, TOKENS, device=device, generator=generator)

    def ours():
        logps, entropy = logps_and_entropy(logits, labels)
        (grad,) = torch.autograd.grad((logps * weights[0] + entropy * weights[1]).sum(), logits)
        return logps, entropy, grad

    ours()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    logps, entropy, grad = ours()
    end.record()
    torch.cuda.synchronize()
    our_peak, our_ms = torch.cuda.max_memory_allocated() - base, start.elapsed_time(end)

    leaf = logits.detach().float().requires_grad_()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    log_probs = torch.log_softmax(leaf, -1)
    ref_logps = log_probs.gather(-1, labels[:, None])[:, 0]
    ref_entropy = -(log_probs.exp() * log_probs).sum(-1)
    (ref_grad,) = torch.autograd.grad((ref_logps * weights[0] + ref_entropy * weights[1]).sum(), leaf)
    plain_peak = torch.cuda.max_memory_allocated() - base

    torch.testing.assert_close(logps, ref_logps, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-3, rtol=1e-4)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref_grad, atol=1e-2 * ref_grad.abs().max().item(), rtol=1e-2)
    # No float32 copy of all the logits stays alive between forward and backward.
    print(f"{path}: forward and backward {our_ms:.1f} ms; peak extra memory {our_peak / 2**20:.0f} MiB "
          f"(plain float32 {plain_peak / 2**20:.0f} MiB)")
    assert our_peak < plain_peak / 2
