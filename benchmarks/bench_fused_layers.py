"""RMSNorm and the SwiGLU activation as fused C passes (`RL2/native/fused_layers.c`) against HF's torch
ops, in the same run.

    python benchmarks/bench_fused_layers.py [--tokens 1232] [--layers 4] [--repeats 5] [--dtype float32]

Forward and backward of decoder layers of SmolLM2-135M's shape (random weights, float32 or bfloat16,
one core as each rank of a CPU run has) on `tokens` packed tokens, 1232 being what a rank of W1 (`bench_ppo_w1.py`)
trains on; first the norms and the activation alone, then whole layers with their matmuls and
attention. Each setting runs in a process of its own; prints the best of `repeats` rounds, what the
layers keep for their backward (the bytes of the tensors autograd saves) and the process's peak
resident memory.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"HF torch ops": "0", "fused (default)": "1"}  # name -> RL2_FUSED_LAYERS
WORKER = """
import json, resource, sys, time
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from RL2.native import use_huge_pages
from RL2.native.fused_layers import install_fused_layers, silu_mul
use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do
torch.set_num_threads(1)
tokens, n_layers, repeats, dtype = json.loads(sys.argv[1])
dtype = getattr(torch, dtype)
config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     num_hidden_layers=n_layers, rms_norm_eps=1e-5)
config._attn_implementation = "sdpa"
torch.manual_seed(0)
layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(n_layers)).to(dtype)
installed = install_fused_layers(layers)
x = torch.randn(1, tokens, 576, dtype=dtype, requires_grad=True)
position_ids = torch.arange(tokens)[None]
rope = LlamaRotaryEmbedding(config)(x, position_ids)

def norms_and_activation(h, gate, up, layer):  # the MLP's forward less its matmuls
    return layer.post_attention_layernorm(layer.input_layernorm(h)), silu_mul(gate, up)

def whole_layers():
    h = x
    for layer in layers:
        h = layer(h, position_embeddings=rope, attention_mask=None, position_ids=position_ids)
        h = h[0] if isinstance(h, tuple) else h
    return h

saved = {}
def count(tensor):
    saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return tensor

gen = torch.Generator().manual_seed(1)
gate, up = (torch.randn(1, tokens, 1536, generator=gen, dtype=dtype).requires_grad_() for _ in range(2))
grad_hidden = torch.randn(1, tokens, 576, generator=gen, dtype=dtype)
grad_act = torch.randn(1, tokens, 1536, generator=gen, dtype=dtype)
results = {}
for name in ("norms and activation", "whole layers"):
    best, kept = float("inf"), 0
    for _ in range(repeats + 1):  # the first round warms up
        saved.clear()
        began = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            if name == "whole layers":
                whole_layers().backward(grad_hidden)
            else:
                for layer in layers:
                    torch.autograd.backward(norms_and_activation(x, gate, up, layer), (grad_hidden, grad_act))
        best = min(best, time.perf_counter() - began)
        kept = sum(saved.values())
        x.grad = gate.grad = up.grad = None
        layers.zero_grad(set_to_none=True)
    results[name] = (best / n_layers, kept / n_layers)
print(json.dumps([installed, results, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1232)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(f"SmolLM2-135M decoder layers, {args.tokens} tokens, {args.dtype}, one core; "
          "per layer, forward and backward, "
          f"best of {args.repeats}\n")
    print("| setting | norms and activation (ms) | saved for backward (MiB) "
          "| whole layer (ms) | saved for backward (MiB) "
          "| peak RSS (GiB) |")
    print("|---|---|---|---|---|---|")
    for name, switch in SETTINGS.items():
        env = dict(os.environ, RL2_FUSED_LAYERS=switch)
        out = subprocess.run([sys.executable, "-c", WORKER,
                              json.dumps([args.tokens, args.layers, args.repeats, args.dtype])],
                             cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
        installed, results, peak_gb = json.loads(out.strip().splitlines()[-1])
        (elem_s, elem_bytes), (layer_s, layer_bytes) = results["norms and activation"], results["whole layers"]
        if bool(installed) != (switch == "1"):
            sys.exit(f"{name}: the kernels were {'not ' if not installed else ''}installed; is a C compiler missing?")
        print(f"| {name} | {1e3 * elem_s:.1f} | {elem_bytes / 2**20:.1f} | {1e3 * layer_s:.1f} | "
              f"{layer_bytes / 2**20:.1f} | {peak_gb:.2f} |")


if __name__ == "__main__":
    main()
