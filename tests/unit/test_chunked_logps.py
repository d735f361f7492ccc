"""Chunked log-probs and entropies against a float64 log-softmax, values and gradients."""

import pytest
import torch

from RL2.models import chunked_logps
from RL2.models.chunked_logps import logps_and_entropy, token_logps


def reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(logits.double(), -1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs.nan_to_num(neginf=0.0)).sum(-1)
    return log_probs.gather(-1, labels[..., None])[..., 0], entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logps_and_entropy_equal_log_softmax(monkeypatch, dtype):
    """Chunks of 3 rows over 10 tokens (the last one short); one masked (-inf) vocabulary entry."""
    monkeypatch.setattr(chunked_logps, "CHUNK_ELEMENTS", 3 * 50)
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 50, generator=generator)).to(dtype)
    logits[0, 1, 7] = float("-inf")
    logits.requires_grad_()
    labels = torch.randint(0, 50, (2, 5), generator=generator)
    labels[0, 1] = 3
    before = logits.detach().clone()

    logps, entropy = logps_and_entropy(logits, labels)
    expected_logps, expected_entropy = reference(logits.detach(), labels)
    torch.testing.assert_close(logps.double(), expected_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.detach(), before)  # the input is not changed in place

    weights = torch.randn(2, 2, 5, generator=generator)
    (grad,) = torch.autograd.grad((logps * weights[0] + entropy * weights[1]).sum(), logits)
    leaf = logits.detach().double().requires_grad_()
    ref_logps, ref_entropy = reference(leaf, labels)
    (expected,) = torch.autograd.grad((ref_logps * weights[0] + ref_entropy * weights[1]).sum(), leaf)
    expected = expected.nan_to_num(nan=0.0)  # d/dz at a -inf logit: p = 0, no gradient
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the gradient is returned in the logits' dtype
    torch.testing.assert_close(grad.double(), expected, atol=tolerance, rtol=tolerance)

    (expected,) = torch.autograd.grad(reference(leaf, labels)[1].sum(), leaf)  # the log-probs unused
    (grad,) = torch.autograd.grad(logps_and_entropy(logits, labels)[1].sum(), logits)
    torch.testing.assert_close(grad.double(), expected.nan_to_num(nan=0.0), atol=tolerance, rtol=tolerance)

    (expected,) = torch.autograd.grad(reference(leaf, labels)[0].sum(), leaf)
    for logps in (logps_and_entropy(logits, labels)[0], token_logps(logits, labels)):  # entropy unused / not made
        torch.testing.assert_close(logps.double(), expected_logps, atol=1e-5, rtol=1e-5)
        (grad,) = torch.autograd.grad(logps.sum(), logits)
        torch.testing.assert_close(grad.double(), expected.nan_to_num(nan=0.0), atol=tolerance, rtol=tolerance)


def test_chunked_logps_at_a_temperature(monkeypatch):
    monkeypatch.setattr(chunked_logps, "CHUNK_ELEMENTS", 4 * 30)
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 30, generator=generator, dtype=torch.float64).float().requires_grad_()
    labels = torch.randint(0, 30, (9,), generator=generator)
    logps = token_logps(logits, labels, temperature=0.7)
    leaf = logits.detach().double().requires_grad_()
    expected = torch.log_softmax(leaf / 0.7, -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(logps.double(), expected, atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad(logps.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), leaf)
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-6, rtol=1e-6)


def test_chunked_entropy_at_a_temperature(monkeypatch):
    """The entropy of softmax(logits / T) and its gradient, with the log-probs' (the actor's entropy bonus
    at the sampling temperature), against float64 autograd of the formula."""
    monkeypatch.setattr(chunked_logps, "CHUNK_ELEMENTS", 4 * 30)
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 30, generator=generator, dtype=torch.float64).float().requires_grad_()
    labels = torch.randint(0, 30, (9,), generator=generator)
    logps, entropy = chunked_logps.logps_and_entropy(logits, labels, temperature=0.7)
    leaf = logits.detach().double().requires_grad_()
    log_probs = torch.log_softmax(leaf / 0.7, -1)
    expected_logps = log_probs.gather(-1, labels[:, None])[:, 0]
    expected_entropy = -(log_probs.exp() * log_probs).sum(-1)
    torch.testing.assert_close(entropy.double(), expected_entropy, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked_logps.entropy(logits, temperature=0.7).double(), expected_entropy,
                               atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad((logps + 0.3 * entropy).sum(), logits)
    (expected_grad,) = torch.autograd.grad((expected_logps + 0.3 * expected_entropy).sum(), leaf)
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_written_over_the_logits(monkeypatch, dtype):
    """`overwrite_logits`: the same gradient as into a tensor of its own, stored in the logits' memory."""
    monkeypatch.setattr(chunked_logps, "CHUNK_ELEMENTS", 4 * 40)
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 8, generator=generator, dtype=dtype, requires_grad=True)
    hidden = torch.randn(11, 8, generator=generator, dtype=dtype)
    labels = torch.randint(0, 40, (11,), generator=generator)
    scale = torch.randn(2, 11, generator=generator)

    def loss(overwrite: bool):
        logits = hidden @ weight.T  # its backward needs hidden and weight, not the logits
        logps, entropy = logps_and_entropy(logits, labels, overwrite_logits=overwrite)
        (logps * scale[0] + entropy * scale[1]).sum().backward()
        return logits

    loss(False)
    expected, weight.grad = weight.grad.clone(), None
    leaf = (hidden @ weight.T).detach().double().requires_grad_()
    ref_logps, ref_entropy = reference(leaf, labels)
    (logits_grad,) = torch.autograd.grad((ref_logps * scale[0] + ref_entropy * scale[1]).sum(), leaf)

    logits = loss(True)
    assert torch.equal(weight.grad, expected)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.detach().double(), logits_grad, atol=tolerance, rtol=tolerance)


def test_overwritten_logits_needed_elsewhere_raise():
    """Logits whose producer's backward needs them (here tanh's) must not be overwritten; autograd says so."""
    pre = torch.randn(6, 30, requires_grad=True)
    logits = torch.tanh(pre)
    logps = token_logps(logits, torch.zeros(6, dtype=torch.long), overwrite_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logps.sum().backward()
