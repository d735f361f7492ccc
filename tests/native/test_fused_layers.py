"""The fused RMSNorm and SwiGLU kernels, forward and backward, against HF's own modules run in float64
(the independent reference): on shapes that take the single-thread and the OpenMP branches, with
silu far into both tails; in bfloat16, against the torch ops the embedded engine runs and no further
from float64 than HF's own bfloat16 modules; and what installing them changes in a whole model."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from RL2.native import fused_layers
from RL2.native.fused_layers import install_fused_layers

pytestmark = pytest.mark.skipif(
    fused_layers._library() is None,
    reason="the fused-layer kernels are unavailable here (no C compiler, or RL2_FUSED_LAYERS=0)",
)


def randn(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def forward_backward(module, inputs, grad_out, parameters_of=None):
    """Output and the gradients of the inputs and parameters (of `parameters_of`, else of `module`), for
    `grad_out` flowing back."""
    owner = parameters_of or module
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    owner.zero_grad(set_to_none=True)
    out = module(*inputs)
    out.backward(grad_out)
    return [out.detach(), *(x.grad for x in inputs), *(p.grad for p in owner.parameters() if p.requires_grad)]


def check_against_float64(module, inputs, grad_out, rtol, atol):
    reference = copy.deepcopy(module).double()  # HF's own forward, unpatched, in float64
    fused = copy.deepcopy(module)
    assert install_fused_layers(fused) == 1
    got = forward_backward(fused, inputs, grad_out)
    expected = forward_backward(reference, [x.double() for x in inputs], grad_out.double())
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e.float(), rtol=rtol, atol=atol)


def norm_module(dim):
    norm = LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(dim, seed=2))
    return norm


@pytest.mark.parametrize("shape", [(3, 64), (2, 300, 576)])  # the second takes the OpenMP branch
def test_rms_norm_forward_and_backward_are_hf_rmsnorm_in_float64(shape):
    dim = shape[-1]
    check_against_float64(norm_module(dim), [randn(*shape, scale=3.0)], randn(*shape, seed=1), 1e-5, 1e-5)


def test_silu_mul_backward_in_the_tails():
    gate = torch.tensor([-120.0, -90.0, -30.0, -1.0, 0.0, 1e-3, 2.0, 30.0, 95.0])
    up = torch.linspace(-2, 2, len(gate))
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    (torch.nn.functional.silu(g64) * u64).sum().backward()
    g32, u32 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = fused_layers._SiluMul.apply(g32, u32)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), (torch.nn.functional.silu(gate.double()) * up.double()).float(),
                               rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(g32.grad, g64.grad.float(), rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(u32.grad, u64.grad.float(), rtol=1e-6, atol=1e-30)


def test_threaded_branch_gives_the_single_thread_result():
    norm = norm_module(576)
    install_fused_layers(norm)
    x, grad = randn(400, 576, scale=2.0), randn(400, 576, seed=1)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(forward_backward(norm, [x], grad))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        torch.testing.assert_close(one, two, rtol=1e-6, atol=1e-6)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).norm() / expected.norm()).item()


def errors_against_float64(module, x, grad_out, dtype):
    """Relative errors of the output and every gradient, for the fused module and for HF's own, both in
    `dtype`, against HF's module run in float64 on the same (`dtype`-valued) weights and inputs."""
    module = module.to(dtype)
    fused = copy.deepcopy(module)
    assert install_fused_layers(fused) == 1
    x, grad_out = x.to(dtype), grad_out.to(dtype)
    expected = forward_backward(copy.deepcopy(module).double(), [x.double()], grad_out.double())
    return [
        [relative_error(g, e) for g, e in zip(forward_backward(m, [x], grad_out), expected)] for m in (fused, module)
    ]


@pytest.mark.parametrize("shape", [(3, 64), (2, 300, 576)])
def test_bf16_rms_norm_is_no_further_from_float64_than_hf(shape):
    fused, hf = errors_against_float64(norm_module(shape[-1]), randn(*shape, scale=3.0), randn(*shape, seed=1),
                                       torch.bfloat16)
    for got, theirs in zip(fused, hf):
        assert got <= theirs and got < 2.5e-3  # one rounding to bfloat16 (2^-9 at most, relative) per result


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 2e-6), (torch.bfloat16, 6e-3)])
@pytest.mark.parametrize("tokens", [5, 300])  # 300 x 1536 takes the OpenMP branch
def test_gated_mlp_is_no_further_from_float64_than_hf(tokens, dtype, bound):
    """The MLP's matmuls round too, by an amount that depends on the CPU's GEMM kernels: HF's own MLP in
    the same dtype sets the bar."""
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=576, intermediate_size=1536, hidden_act="silu"))
    x = randn(1, tokens, 576, scale=4.0)  # gate activations far into silu's tails
    fused, hf = errors_against_float64(mlp, x, randn(1, tokens, 576, seed=1), dtype)
    for got, theirs in zip(fused, hf):
        assert got <= theirs * 1.01 + 1e-7 and got < bound


def small_mlp():
    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=160, hidden_act="silu"))


def activation_bytes_kept(mlp, x):
    """Bytes of the tensors autograd keeps for the backward of `mlp(x)`, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x.detach().requires_grad_())
    return sum(kept.values())


def test_gated_mlp_keeps_its_input_gate_and_up_but_not_their_product():
    mlp, tokens = small_mlp(), 30
    x, floats = randn(1, tokens, 64), 4
    # HF keeps x (for gate's and up's weight gradients), gate (silu's), silu(gate) and up (the product's) and
    # the product (the down projection's): 64 + 4 * 160 floats a token.
    assert activation_bytes_kept(mlp, x) == tokens * (64 + 4 * 160) * floats
    install_fused_layers(mlp)
    assert activation_bytes_kept(mlp, x) == tokens * (64 + 2 * 160) * floats


def test_gated_mlp_with_a_frozen_down_projection_passes_the_gradient_through():
    mlp = small_mlp()
    mlp.down_proj.weight.requires_grad_(False)
    reference = copy.deepcopy(mlp).double()
    install_fused_layers(mlp)
    x, grad_out = randn(2, 7, 64, scale=3.0), randn(2, 7, 64, seed=1)
    got = forward_backward(mlp, [x], grad_out)
    expected = forward_backward(reference, [x.double()], grad_out.double())
    assert mlp.down_proj.weight.grad is None
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change", ["forward hook", "bias"])
def test_gated_mlp_calls_a_down_projection_that_is_more_than_a_weight(change):
    """A hooked Linear (as a wrapper of FSDP or LoRA may be) or one with a bias runs as a module."""
    mlp = small_mlp()
    if change == "bias":
        mlp.down_proj.bias = torch.nn.Parameter(randn(64, seed=4))
    reference = copy.deepcopy(mlp).double()
    calls = []
    if change == "forward hook":
        mlp.down_proj.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    install_fused_layers(mlp)
    x, grad_out = randn(1, 9, 64, scale=3.0), randn(1, 9, 64, seed=1)
    got = forward_backward(mlp, [x], grad_out)
    expected = forward_backward(reference, [x.double()], grad_out.double())
    assert len(calls) == (change == "forward hook")
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e.float(), rtol=1e-5, atol=1e-5)


class NormThenProjections(torch.nn.Module):
    """A norm read by two input projections, one with a bias, as an attention's q and v are."""

    def __init__(self, dim=64, out=48):
        super().__init__()
        self.input_layernorm = norm_module(dim)
        self.q_proj = torch.nn.Linear(dim, out, bias=False)
        self.v_proj = torch.nn.Linear(dim, out, bias=True)

    def forward(self, x, change_in_place=False):
        normed = self.input_layernorm(x)
        if change_in_place:
            normed.mul_(2.0)
        return self.q_proj(normed) + self.v_proj(normed)


def test_input_projections_keep_the_norms_input_not_its_output():
    torch.manual_seed(0)
    module, tokens = NormThenProjections(), 30
    install_fused_layers(module)
    # The norm keeps its input and one float32 per token; the projections keep nothing more.
    assert activation_bytes_kept(module, randn(1, tokens, 64)) == tokens * (64 + 1) * 4


@pytest.mark.parametrize("change_in_place", [False, True])
def test_input_projections_train_like_hf_in_float64(change_in_place):
    """Gradients of the norm and of both projections, the norm's output computed again in the backward;
    an output changed in place after the norm is kept as it is."""
    torch.manual_seed(0)
    module = NormThenProjections()
    reference = copy.deepcopy(module).double()
    install_fused_layers(module)
    x, grad_out = randn(2, 11, 64, scale=3.0), randn(2, 11, 48, seed=1)
    got = forward_backward(lambda h: module(h, change_in_place), [x], grad_out, module)
    expected = forward_backward(lambda h: reference(h, change_in_place), [x.double()], grad_out.double(), reference)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e.float(), rtol=1e-5, atol=1e-5)


def test_projections_of_one_norm_compute_its_output_once(monkeypatch):
    calls = []
    original = fused_layers._rms_norm_again
    monkeypatch.setattr(fused_layers, "_rms_norm_again", lambda *args: calls.append(1) or original(*args))
    torch.manual_seed(0)
    module = NormThenProjections()
    install_fused_layers(module)
    out = module(randn(1, 9, 64).requires_grad_())
    out.sum().backward(retain_graph=True)
    first = [p.grad.clone() for p in module.parameters()]
    assert len(calls) == 1  # q's backward computes it, v's reuses it
    module.zero_grad(set_to_none=True)
    out.sum().backward()  # again through the same graph: each reader computes it, with the same result
    assert len(calls) == 3
    for p, grad in zip(module.parameters(), first):
        assert torch.equal(p.grad, grad)


def test_bf16_input_projection_computes_the_norms_output_exactly_again():
    """The backward's norm output is the forward's, bit for bit: the weight gradient is the one HF's Linear
    computes from the kept output."""
    torch.manual_seed(0)
    module = NormThenProjections().to(torch.bfloat16)
    install_fused_layers(module)
    x, grad_out = randn(1, 300, 64, scale=3.0).to(torch.bfloat16), randn(1, 300, 48, seed=1).to(torch.bfloat16)
    recomputed = forward_backward(module, [x], grad_out)

    def keeping_the_output(h):
        normed = module.input_layernorm(h) + 0  # a new tensor, with no norm to compute it again from
        return module.q_proj(normed) + module.v_proj(normed)

    kept = forward_backward(keeping_the_output, [x], grad_out, module)
    for a, b in zip(recomputed, kept):
        assert torch.equal(a, b)


def test_bf16_forward_is_what_the_embedded_engine_computes():
    """The engine runs F.rms_norm (one rounding) and F.silu(gate) * up (silu rounded, then the
    product) in bfloat16; the trainer's fused forward rounds at the same points, so log-probs of the
    two agree as before."""
    norm = norm_module(576).to(torch.bfloat16)
    install_fused_layers(norm)
    x = randn(300, 576, scale=3.0).to(torch.bfloat16)
    got, engine = norm(x).float(), torch.nn.functional.rms_norm(x, (576,), norm.weight, norm.variance_epsilon).float()
    # The sums of squares run in another order: rarely, a result lands on the other side of a rounding.
    assert (got != engine).float().mean() < 1e-3
    torch.testing.assert_close(got, engine, rtol=2**-7, atol=0)
    gate, up = (randn(300, 1536, scale=4.0, seed=s).to(torch.bfloat16) for s in (1, 2))
    assert torch.equal(fused_layers.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)


def test_other_dtypes_run_hf_code_unchanged():
    norm = norm_module(64).to(torch.float16)
    fused = copy.deepcopy(norm)
    install_fused_layers(fused)
    x = randn(4, 64).to(torch.float16)
    assert torch.equal(fused(x), norm(x))
    assert not fused_layers._fusable(x.float(), norm.weight)  # mixed dtypes too


def tiny_llama(layers=3):
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_installed_model_trains_like_hf_in_float64():
    model = tiny_llama(layers=3)
    reference = copy.deepcopy(model).double()
    assert install_fused_layers(model) == 3 * 2 + 1 + 3  # two norms and one MLP a layer, the final norm
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))
    for m in (model, reference):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), p64 in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p64.grad.float(), rtol=1e-4, atol=1e-6, msg=name)


def test_switched_off_installs_nothing(monkeypatch):
    monkeypatch.setenv("RL2_FUSED_LAYERS", "0")
    fused_layers._library.cache_clear()
    try:
        assert install_fused_layers(tiny_llama(layers=1)) == 0
    finally:
        monkeypatch.delenv("RL2_FUSED_LAYERS")
        fused_layers._library.cache_clear()
    assert fused_layers._library() is not None


class Wrapped(torch.Tensor):
    """A tensor subclass, as tensor parallelism's asynchronous outputs are."""


def test_tensor_subclasses_run_hf_code():
    norm = norm_module(64)
    fused = copy.deepcopy(norm)
    install_fused_layers(fused)
    x = randn(4, 64).as_subclass(Wrapped)
    assert not fused_layers._fusable(x)
    torch.testing.assert_close(fused(x).as_subclass(torch.Tensor), norm(x).as_subclass(torch.Tensor), rtol=0, atol=0)


def test_a_gradient_the_kernels_cannot_read_raises_a_clear_error():
    with pytest.raises(TypeError, match="RL2_FUSED_LAYERS=0"):
        fused_layers._plain_gradient(torch.ones(3, dtype=torch.float16), torch.ones(3), "RMSNorm")
