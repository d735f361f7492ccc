"""Decode attention of one step of the embedded model: the engine's C kernel (`decode_attention` of
`RL2/native/decode_kernels.c`) against the torch ops that run where it cannot be built
(`attend_one_token`), in the same run, on one core.

    python benchmarks/bench_decode_attention.py [--rows 16,32] [--lengths 64,128] [--steps 20] [--dtype float32]
                                                [--group 4] [--prompt 40] [--isa avx2]

A step attends one new query per row over that row's cached keys and values in each of the 30 layers of
SmolLM2-135M-Instruct's shapes (9 query heads, 3 kv heads, head_dim 64), every row at the same length,
random caches laid out as the engine's `SlotKVCache` (each layer its own buffer, so they are read from
memory, as in a real step) in the model's dtype: keys and values in it for the C kernel, float32 keys for
the torch ops (the cache keeps them so there). Prints milliseconds per step and the rate at which the step reads its
keys and values, against what one core reads from memory in the same run (a sum over 512 MB), and the
process's peak resident memory. A third row times the C kernel with the rows in groups of `--group` that
share their first `--prompt` positions (a GRPO group's responses to one prompt, whose rows hold copies of
it), which it then reads once per group (`RowGroups`).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from common import add_isa_argument, run_with_isa  # noqa: E402

from RL2.engine.embedded.llama_forward import attend_one_token, attention_bias  # noqa: E402
from RL2.native import use_huge_pages  # noqa: E402
from RL2.native.decode_kernels import RowGroups, load_decode_kernels  # noqa: E402
from RL2.utils.memory import peak_rss_gb  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def read_rate(gigabytes: float = 0.5, rounds: int = 5) -> float:
    """Bytes per second one core reads from memory: the best of `rounds` sums over a fresh-enough tensor."""
    data = torch.ones(int(gigabytes * 2**30) // 4)
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - began)
    return data.numel() * 4 / best


def step_functions(rows: int, length: int, dtype: torch.dtype, group: int, prompt: int) -> dict:
    """name -> (a callable running one step's attention (all layers) with that implementation, bytes of
    the cache it reads)."""
    generator = torch.Generator().manual_seed(0)
    cache_len = max(128, 1 << (length - 1).bit_length())  # the cache grows by doubling
    shape = (rows, KV_HEADS, cache_len, HEAD_DIM)
    caches = [tuple(torch.randn(*shape, generator=generator).to(dtype) for _ in range(2)) for _ in range(LAYERS)]
    groups, prompt = -(-rows // group), min(prompt, length)
    for keys, values in caches:  # each group's rows hold copies of its first row's prompt, as the engine's do
        for first in range(0, rows, group):
            keys[first + 1 : first + group, :, :prompt] = keys[first, :, :prompt]
            values[first + 1 : first + group, :, :prompt] = values[first, :, :prompt]
    row_groups = RowGroups(order=torch.arange(rows),
                           starts=torch.tensor([min(i * group, rows) for i in range(groups + 1)]),
                           shared=torch.full((groups,), prompt))
    float32_keys = [keys.float() for keys, _ in caches]
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=generator).to(dtype).float()
    positions = torch.full((rows,), length - 1)
    scale = HEAD_DIM**-0.5
    kernels, out = load_decode_kernels(), torch.empty(rows, HEADS * HEAD_DIM, dtype=dtype)
    bias = attention_bias(torch.arange(length)[None, :] <= positions[:, None])
    positions_read = LAYERS * rows * KV_HEADS * length * HEAD_DIM
    return {
        "decode_attention (C)": (lambda: [
            kernels.decode_attention(query, keys, values, positions, scale, out) for keys, values in caches
        ], positions_read * 2 * dtype.itemsize),
        f"decode_attention (C), groups of {group} reading {prompt} positions once": (lambda: [
            kernels.decode_attention(query, keys, values, positions, scale, out, row_groups) for keys, values in caches
        ], positions_read // (rows * length) * (groups * prompt + rows * (length - prompt)) * 2 * dtype.itemsize),
        "torch ops": (lambda: [
            attend_one_token(query.to(dtype), keys[:, :, :length], values[:, :, :length], bias, scale)
            for keys, (_, values) in zip(float32_keys, caches)
        ], positions_read * (4 + dtype.itemsize)),
    }


def time_step(step, steps: int) -> float:
    for _ in range(3):
        step()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - began) / steps


def main() -> None:
    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32", help="comma-separated rows per step (running requests)")
    parser.add_argument("--lengths", default="64,128", help="comma-separated cached positions a row attends over")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    parser.add_argument("--group", type=int, default=4, help="rows a prompt has (responses per prompt)")
    parser.add_argument("--prompt", type=int, default=40, help="positions of a group's shared prompt")
    add_isa_argument(parser)
    args = parser.parse_args()
    run_with_isa(args.isa)
    dtype = getattr(torch, args.dtype)
    if load_decode_kernels() is None:
        sys.exit("the C decode kernels cannot be built here (no C compiler?): nothing to compare")
    torch.set_num_threads(1)
    with torch.inference_mode():
        memory_rate = read_rate()
        print(f"\none core reads {memory_rate / 1e9:.1f} GB/s from memory (a sum over 512 MB, best of 5)")
        print(f"\n{args.dtype} model, {args.isa} instructions")
        print("\n| rows | length | implementation | ms per step | keys and values read (GB/s) "
              "| share of the memory rate |")
        print("|---|---|---|---|---|---|")
        for rows in [int(r) for r in args.rows.split(",")]:
            for length in [int(n) for n in args.lengths.split(",")]:
                for name, (step, bytes_read) in step_functions(rows, length, dtype, args.group, args.prompt).items():
                    seconds = time_step(step, args.steps)
                    rate = bytes_read / seconds
                    print(f"| {rows} | {length} | {name} | {seconds * 1e3:.2f} | {rate / 1e9:.1f} | "
                          f"{rate / memory_rate:.0%} |")
    print(f"\npeak RSS of the process: {peak_rss_gb():.2f} GB")


if __name__ == "__main__":
    main()
