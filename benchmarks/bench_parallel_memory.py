"""Memory per rank under FSDP and tensor parallelism, and context-parallel throughput on long sequences.

    python benchmarks/bench_parallel_memory.py [--mem-seq-len 64] [--cp-seq-len 1024] [--steps 1]

Memory: the embedded model (135 M parameters, float32 master weights) at 1, 2 and 4 ranks of FSDP and
at tp=3 (its 9 query and 3 key/value heads split 3 ways, not 2): bytes each rank holds of parameters,
gradients and AdamW state (its shards, counted from the
tensors after one training step), and its peak resident memory.
Throughput: one sequence of `--cp-seq-len` tokens trained on 1 rank (cp=1) and split over 2 ranks
(cp=2): seconds per step, tokens/s and peak resident memory per rank. On this 2-core CPU the ranks
share the cores (threads per rank = cores / ranks), so cp=2 shows the memory split more than a speed-up.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_sft_steps, run_worker  # noqa: E402


def worker(args) -> None:
    """Runs under torchrun: one layout, `args.steps` training steps on synthetic tokens."""
    import torch.distributed as dist

    from RL2.native import use_huge_pages
    from RL2.parallel import close_process_groups

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    seq_parallel = args.tp * args.cp
    _, figures = measure_sft_steps({"dtype": "float32", "tp_size": args.tp, "cp_size": args.cp,
                                    "max_length_per_device": -(-args.seq_len // seq_parallel)},
                                   args.seq_len, args.seqs, args.steps)
    if dist.get_rank() == 0:
        print(json.dumps(figures))
    close_process_groups()


def run(nproc: int, tp: int, cp: int, seq_len: int, seqs: int, steps: int) -> dict:
    return run_worker(__file__, nproc, [f"--tp={tp}", f"--cp={cp}", f"--seq-len={seq_len}", f"--seqs={seqs}",
                                        f"--steps={steps}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--seqs", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--mem-seq-len", type=int, default=64,
                        help="tokens per sequence of the memory runs (4 sequences)")
    parser.add_argument("--cp-seq-len", type=int, default=1024, help="tokens of the one long sequence of the cp runs")
    parser.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print("| layout | ranks | params MiB/rank | grads MiB/rank | AdamW state MiB/rank | peak RSS MiB/rank |")
    print("|---|---|---|---|---|---|")
    for name, nproc, tp in (("fsdp=1", 1, 1), ("fsdp=2", 2, 1), ("fsdp=4", 4, 1), ("tp=3", 3, 3)):
        r = run(nproc, tp, 1, args.mem_seq_len, 4, args.steps)
        print(f"| {name} | {nproc} | {r['params_mb']:.0f} | {r['grads_mb']:.0f} | {r['optim_mb']:.0f} | "
              f"{r['peak_rss_mb']:.0f} |", flush=True)
    print()
    print(f"| context parallel, 1 sequence of {args.cp_seq_len} tokens "
          "| ranks | s/step | tokens/s | peak RSS MiB/rank |")
    print("|---|---|---|---|---|")
    for cp in (1, 2):
        r = run(cp, 1, cp, args.cp_seq_len, 1, args.steps)
        print(f"| cp={cp} | {cp} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
