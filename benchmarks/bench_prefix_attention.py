"""Shared-prefix attention of one decoder layer on CPU: the C kernel (`RL2/native/prefix_attention.c`)
against one SDPA call per prefix and per branch (`RL2_PREFIX_ATTENTION=0`), in the same run.

    python benchmarks/bench_prefix_attention.py [--groups 4] [--prompt 48] [--responses 4] [--response 64] [--isa avx2]

A row as one rank of W1 (`bench_ppo_w1.py`) trains on: `groups` prompts of `prompt` tokens, each with
`responses` branches of `response` tokens, SmolLM2-135M's attention shape (9 query heads, 3 kv heads,
head size 64), random inputs, one core. Per dtype and path: forward, backward (best of `--repeats`
rounds, the two paths alternating, with glibc keeping freed memory as the trainers have it), and the
bytes autograd keeps for the backward.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_isa_argument, run_with_isa  # noqa: E402

from RL2.models import shared_prefix  # noqa: E402
from RL2.models.shared_prefix import Block, SharedPrefixRow  # noqa: E402
from RL2.native import use_huge_pages  # noqa: E402
from RL2.native.allocator import keep_freed_memory  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def row_of(groups: int, prompt: int, responses: int, response: int) -> SharedPrefixRow:
    blocks = [Block(start=g * (prompt + responses * response), prefix=prompt, branches=[response] * responses)
              for g in range(groups)]
    return SharedPrefixRow(None, None, None, None, blocks)


def one_round(row: SharedPrefixRow, inputs, grad_out, kernel: bool) -> tuple[float, float, int]:
    """(forward s, backward s, bytes saved for backward) of one forward and backward."""
    usable = shared_prefix.usable
    if not kernel:
        shared_prefix.usable = lambda *tensors: False
    leaves = [x.detach().requires_grad_() for x in inputs]
    saved = []
    try:
        began = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = row.attention(*leaves, HEAD_DIM ** -0.5)
        forward = time.perf_counter() - began
    finally:
        shared_prefix.usable = usable
    began = time.perf_counter()
    out.backward(grad_out)
    backward = time.perf_counter() - began
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return forward, backward, sum(kept.values())


def main() -> None:
    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    add_isa_argument(parser)
    args = parser.parse_args()
    run_with_isa(args.isa)
    torch.set_num_threads(1)
    keep_freed_memory()  # as the trainers do: freed memory is reused, not faulted in again
    row = row_of(args.groups, args.prompt, args.responses, args.response)
    tokens = row.runs().shape[1]
    print(f"one layer's shared-prefix attention: {args.groups} x ({args.prompt} + {args.responses} x {args.response}) "
          f"= {tokens} tokens, {HEADS} heads / {KV_HEADS} kv heads of {HEAD_DIM}, one core, {args.isa} instructions")
    print(f"{'dtype':<9} {'path':<18} {'forward ms':>10} {'backward ms':>11} {'total ms':>8} {'kept MB':>7}")
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        # Tokens-major storage, as the model's projections leave q, k and v.
        inputs = [torch.randn(1, tokens, n, HEAD_DIM, generator=g).to(dtype).transpose(1, 2)
                  for n in (HEADS, KV_HEADS, KV_HEADS)]
        grad_out = torch.randn(1, tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
        best = {True: [float("inf")] * 2, False: [float("inf")] * 2}
        kept = {}
        for _ in range(args.repeats):
            for kernel in (True, False):
                forward, backward, kept[kernel] = one_round(row, inputs, grad_out, kernel)
                best[kernel] = [min(best[kernel][0], forward), min(best[kernel][1], backward)]
        for kernel, name in ((False, "SDPA calls"), (True, "prefix_attention.c")):
            forward, backward = best[kernel]
            print(f"{str(dtype).removeprefix('torch.'):<9} {name:<18} {forward * 1e3:>10.2f} {backward * 1e3:>11.2f} "
                  f"{(forward + backward) * 1e3:>8.2f} {kept[kernel] / 1e6:>7.2f}")


if __name__ == "__main__":
    main()
