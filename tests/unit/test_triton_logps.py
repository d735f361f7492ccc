"""The CUDA log-prob kernels (`RL2.models.triton_logps`) run by Triton's interpreter on the CPU, against
float64 autograd: log-probs, entropies and both gradients at a temperature, with masked (-inf) logits,
in float32 and bf16. Runs on machines without a GPU where Triton is installed (Triton 3.9's interpreter
was checked; 3.6's fails on numpy 2.5 before running a kernel). On a GPU, tests/gpu/test_cuda_logps.py
runs the compiled kernels instead."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="Triton is not installed (CUDA builds of torch ship it)"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the compiled kernels (tests/gpu)")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kernels_equal_float64_autograd(dtype, temperature):
    # Triton reads TRITON_INTERPRET when it is imported: a fresh process, whatever this one imported.
    check = f"from tests.unit.test_triton_logps import check; check('{dtype}', {temperature})"
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def reference(logits, labels, temperature):
    """(log p(labels), entropy) in float64 with autograd, -inf logits as probability 0."""
    leaf = logits.double().requires_grad_()
    log_probs = torch.log_softmax(leaf / temperature, -1)
    logps = log_probs.gather(-1, labels[:, None])[:, 0]
    allowed = log_probs > float("-inf")
    safe = torch.where(allowed, log_probs, 0.0)  # no inf * 0 in the masked entries' backward either
    entropy = -torch.where(allowed, safe.exp() * safe, 0.0).sum(-1)
    return leaf, logps, entropy


def check(dtype_name: str, temperature: float) -> None:
    from RL2.models import triton_logps as kernels

    dtype = getattr(torch, dtype_name)
    grad_tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]  # bf16: the gradient's own rounding
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 6, 3 * kernels.BLOCK // 2 + 5  # blocks of the row: one full, one partial
    logits = (3 * torch.randn(rows, vocab, generator=generator)).to(dtype)
    logits[1, 100:900] = float("-inf")  # a masked stretch
    logits[2, :] = float("-inf")  # a row with two allowed entries, one the label
    logits[2, 17], logits[2, vocab - 1] = 1.0, 2.0
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[2] = 17
    leaf, ref_logps, ref_entropy = reference(logits, labels, temperature)

    logps, lse, entropy = kernels.forward(logits, labels, temperature)
    torch.testing.assert_close(logps.double(), ref_logps.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double() / temperature, -1), atol=1e-5, rtol=1e-5)

    grad_logps = torch.randn(rows, generator=generator)
    grad_entropy = 4 * torch.randn(rows, generator=generator)  # large enough to overflow a -inf logit's term
    for with_entropy in (False, True):
        loss = (ref_logps * grad_logps.double()).sum()
        if with_entropy:
            loss = loss + (ref_entropy * grad_entropy.double()).sum()
        (expected,) = torch.autograd.grad(loss, leaf, retain_graph=True)
        grad = kernels.backward(logits, labels, lse, entropy, grad_logps, grad_entropy if with_entropy else None,
                                temperature)
        assert grad.dtype == dtype and not grad.isnan().any()
        torch.testing.assert_close(grad.double(), expected, atol=grad_tolerance * expected.abs().max().item(),
                                   rtol=grad_tolerance)
        assert (grad[1, 100:900] == 0).all()  # masked entries get no gradient
