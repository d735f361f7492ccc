"""The linear layers of one decode step of the embedded model: the engine's product (`panel_linear` of
`RL2/native/decode_kernels.c`) against oneDNN's packed GEMM, which the engine used before, and
the plain `F.linear`, in the same run.

    python benchmarks/bench_decode_linears.py [--rows 16,32] [--steps 20] [--dtype float32]

A step multiplies `rows` hidden states with every linear weight of SmolLM2-135M-Instruct's shapes (q/k/v
and gate/up as one product each, as the engine runs them; the tied output projection last), random
weights in float32 or bfloat16 (bf16 panels need a CPU with AVX512-BF16). Each product is timed in three
settings: one process on one core; two processes on
one core each at once (two ranks' engines on one host, which compete for memory); one process on every
core. Prints milliseconds per step, GFLOP/s and the share of the matmul peak of those cores measured
(in the dtype) in the same run, and each setting's peak resident memory.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from common import cpu_kind, matmul_peak  # noqa: E402

# (out_features, in_features) of one decoder layer's products and of the output projection.
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, HEAD = 30, (49152, 576)
PRODUCTS = ("panel_linear", "oneDNN packed", "F.linear")


def step_function(product: str, rows: int, dtype: torch.dtype):
    """A callable running one decode step's linear layers with `product`."""
    from RL2.native.decode_kernels import load_decode_kernels

    torch.manual_seed(0)
    shapes = LAYER * LAYERS + [HEAD]
    weights = [(torch.randn(n, k) * 0.02).to(dtype) for n, k in shapes]
    inputs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in shapes}}
    if product == "panel_linear":
        kernels = load_decode_kernels()
        packed = [(kernels.pack_panels([w]), w.shape[0], inputs[w.shape[1]]) for w in weights]
        return lambda: [kernels.panel_linear(x, p, n, None) for p, n, x in packed]
    if product == "oneDNN packed":
        packed = [(torch.ops.mkldnn._reorder_linear_weight(w), inputs[w.shape[1]]) for w in weights]
        return lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p, x in packed]
    return lambda: [F.linear(inputs[w.shape[1]], w) for w in weights]


def worker(product: str, rows: int, steps: int, dtype: torch.dtype) -> None:
    """Time `steps` decode steps in this process; print seconds per step and peak RSS as JSON."""
    from RL2.native import use_huge_pages
    from RL2.utils.memory import peak_rss_gb

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    step = step_function(product, rows, dtype)
    for _ in range(3):
        step()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    print(json.dumps({"step_s": (time.perf_counter() - began) / steps, "peak_gb": peak_rss_gb()}))


def run(product: str, rows: int, steps: int, processes: int, threads: int, dtype: str) -> list[dict]:
    """`processes` workers at once, `threads` torch threads each; their JSON results."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--worker", product, "--rows", str(rows), "--steps", str(steps),
               "--dtype", dtype]
    running = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in running]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32", help="comma-separated rows per step (running requests)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.worker:
        return worker(args.worker, int(args.rows), args.steps, dtype)
    from RL2.native import use_huge_pages
    from RL2.native.decode_kernels import load_decode_kernels

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    kernels = load_decode_kernels()
    if kernels is None:
        sys.exit("the C decode kernels cannot be built here (no C compiler?): nothing to compare")
    if dtype == torch.bfloat16 and not kernels.bf16_panel_rows:
        sys.exit("bf16 panels are built for CPUs with AVX512-BF16, which this one lacks: nothing to compare")
    cores = os.cpu_count() or 1
    torch.set_num_threads(1)
    peak_one = matmul_peak(dtype)
    torch.set_num_threads(cores)
    peak_all = matmul_peak(dtype)
    flops_per_row = 2 * (sum(n * k for n, k in LAYER) * LAYERS + HEAD[0] * HEAD[1])
    settings = [("1 process, 1 core", 1, 1, peak_one), ("2 processes, 1 core each, at once", 2, 1, peak_one),
                (f"1 process, {cores} cores", 1, cores, peak_all)]
    print(f"\n{cpu_kind()}; {args.dtype} matmul peak: {peak_one / 1e9:.0f} GFLOP/s on 1 core, {peak_all / 1e9:.0f} "
          f"on {cores}")
    print("\n| rows | setting | product | ms per step | GFLOP/s per process | % of the peak of its cores | "
          "peak RSS of a process (GB) |")
    print("|---|---|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        for name, processes, threads, peak in settings:
            if processes > cores:
                continue
            for product in PRODUCTS:
                results = run(product, rows, args.steps, processes, threads, args.dtype)
                step_s = max(r["step_s"] for r in results)
                rate = flops_per_row * rows / step_s
                print(f"| {rows} | {name} | {product} | {step_s * 1e3:.1f} | {rate / 1e9:.0f} | {rate / peak:.0%} | "
                      f"{max(r['peak_gb'] for r in results):.2f} |")


if __name__ == "__main__":
    main()
