"""The engine's forwards against the model's own forward: its own for the Llama families, HF's modules for others.

Each model is tiny and random (float32 and bf16; Llama families decode both through the C kernels of
`decode_kernels.c` and through the torch ops that stand in for them); the runner prefills a batch of prompts
of different lengths (two of
them sharing a long prefix, which is computed once), then decodes several tokens per row (rows at
different positions). The prefill's logits and every decode step's must equal the logits of one
plain forward over the whole sequence so far.
"""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from RL2.engine.embedded import llama_forward, packed_linear
from RL2.engine.embedded.model_runner import MIN_SHARED_PREFIX, ModelRunner
from RL2.engine.embedded.packed_linear import PanelLinear
from RL2.native.decode_kernels import load_decode_kernels

SIZES = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
    vocab_size=300, max_position_embeddings=256,
)
FAMILIES = {
    "llama": lambda: LlamaConfig(**SIZES),
    "llama-rope-scaled": lambda: LlamaConfig(**SIZES, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }),
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**SIZES),  # biases on q, k, v
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=32),  # per-head q/k norms, head_dim != hidden/heads
    # Not a Llama (scaled embeddings, (1 + w) norms): HF's modules with the engine's attention and linears.
    "gemma": lambda: GemmaConfig(**SIZES, head_dim=16),
    # Capped attention scores (cap * tanh(scores / cap)), which SDPA cannot apply; a low cap, so that it shows.
    "gemma2": lambda: Gemma2Config(**SIZES, head_dim=16, attn_logit_softcapping=1.0, query_pre_attn_scalar=16),
}


def random_model(config, dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # random biases and norm weights, so that skipping one shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model


# float32 with large weights: sharp attention, so positions and norms change the logits a lot;
# bf16 with HF's small initial weights, where its own rounding (~0.005 here) stays far below 0.02.
DTYPES = {"fp32": (torch.float32, 0.2, 1e-3), "bf16": (torch.bfloat16, 0.02, 0.02)}
# How decode steps run: with the C library, its products serve every family (float32; bf16 with AVX512-BF16)
# and its step kernels the Llama families; without it (no C compiler), oneDNN's products and torch ops.
CASES = [(family, dtype, decode) for family in FAMILIES for dtype in DTYPES for decode in ("c-kernels", "torch-ops")]


@pytest.mark.parametrize("family,dtype,decode", CASES)
def test_prefill_and_decode_match_the_models_forward(family, dtype, decode, monkeypatch):
    dtype, init, tolerance = DTYPES[dtype]
    config = FAMILIES[family]()
    config.initializer_range = init
    model = random_model(config, dtype)
    if decode == "c-kernels":
        if load_decode_kernels() is None:
            pytest.skip("the C decode kernels are unavailable here (no C compiler, or RL2_DECODE_KERNELS=0)")
    else:  # as without a C compiler: oneDNN's packed linears (or plain products) and torch ops
        for module in (llama_forward, packed_linear):
            monkeypatch.setattr(module, "load_decode_kernels", lambda: None)
    runner = ModelRunner(model, max_rows=8)
    assert (runner.llama is not None) == (not family.startswith("gemma")), \
        "Llama families take the engine's own forward"
    if runner.llama is not None:
        assert (runner.llama.decode_kernels is not None) == (decode == "c-kernels")
    # float32 everywhere the library builds, bf16 with AVX512-BF16: the C products; else oneDNN's or plain ones
    products = runner.head if runner.llama is not None else next(iter(runner.packed.values()), None)
    assert isinstance(products, PanelLinear) == (decode == "c-kernels" and runner.panel_kernels is not None)
    generator = torch.Generator().manual_seed(1)

    def random_tokens(n: int) -> list[int]:
        return torch.randint(0, 300, (n,), generator=generator).tolist()

    def expect_last_logits(logits: torch.Tensor, sequences: list[list[int]]) -> None:
        for row, sequence in enumerate(sequences):
            with torch.no_grad():
                expected = model(torch.tensor([sequence])).logits[0, -1].float()
            torch.testing.assert_close(logits[row].float(), expected, atol=tolerance, rtol=0)

    shared = random_tokens(MIN_SHARED_PREFIX + 4)
    sequences = [shared + random_tokens(3), shared + random_tokens(7)]  # the prefix is computed once
    expect_last_logits(runner.prefill(0, sequences), sequences)
    joining = [random_tokens(5), random_tokens(9)]  # rows 2-3, while rows 0-1 are cached
    expect_last_logits(runner.prefill(2, joining), joining)
    sequences += joining
    for _ in range(20):  # crosses the original 16 positions of the scaled rope
        tokens = random_tokens(len(sequences))
        logits = runner.decode(tokens, [len(s) for s in sequences])
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)
        expect_last_logits(logits, sequences)
