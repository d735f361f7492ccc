"""SFT step throughput of the embedded model on CPU, against the machine's matmul peak measured in the same run.

    python benchmarks/bench_sft.py [--dtype float32] [--steps 3] [--seqs 8] [--seq-len 256]

For fp32 and bf16 (or the one `--dtype` names), at 1 and 2 ranks: tokens/s, seconds per step, achieved
FLOP/s of the training step (6 x matmul parameters x tokens + causal attention), that as a fraction of
the matmul peak of the same dtype, and peak resident memory per rank.
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import matmul_peak, run_worker  # noqa: E402


def step_flops(config, n_matmul_params: int, seq_lens: list[int]) -> float:
    """Training FLOPs: 3 x forward; forward = 2 per matmul parameter per token + causal attention scores."""
    tokens = sum(seq_lens)
    attention = sum(4 * config.num_hidden_layers * config.hidden_size * n * n / 2 for n in seq_lens)
    return 3 * (2 * n_matmul_params * tokens + attention)


def worker(args) -> None:
    """Runs under torchrun: time SFT steps of the embedded model on synthetic packed data."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from RL2.batch import SequenceBatch
    from RL2.config.schema import ModelConfig
    from RL2.models.logps import packed_logps
    from RL2.native import use_huge_pages
    from RL2.packing import pack, train_weights
    from RL2.parallel import ParallelDims, close_process_groups, init_distributed, pick_device
    from RL2.workers.fsdp import FSDPWorker

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    device = pick_device("cpu")
    init_distributed(device)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"dtype": args.dtype, "max_length_per_device": 8192})
    dims = ParallelDims.from_config(cfg, device)
    model = FSDPWorker(cfg, dims, device, total_steps=100)
    generator = torch.Generator().manual_seed(0)
    examples = [
        {"input_ids": torch.randint(0, 49152, (args.seq_len + 1,), generator=generator).tolist(),
         "loss_mask": [1] * (args.seq_len + 1)}
        for _ in range(args.seqs)
    ]
    batch = SequenceBatch.from_examples(examples)
    micro_batches = pack(batch, dims.dp_rank, dims.dp, cfg.max_length_per_device, train_weights(batch, "token"))
    times = []
    for step in range(args.steps + 1):  # the first step warms up
        began = time.perf_counter()
        for mb in micro_batches:
            model.backward(-(packed_logps(model.model, mb) * mb.loss_weights).sum())
        model.optimizer_step()
        dist.barrier()
        times.append(time.perf_counter() - began)
    hf_config = model.model.config
    n_params = sum(p.numel() for p in model.model.parameters())
    # The input embedding is a lookup, not a matmul; with tied weights it is also the LM head (a matmul).
    n_matmul = n_params - (0 if hf_config.tie_word_embeddings else hf_config.vocab_size * hf_config.hidden_size)
    step_s = sorted(times[1:])[len(times[1:]) // 2]
    peak_rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], dtype=torch.float64)
    dist.all_reduce(peak_rss, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        flops = step_flops(hf_config, n_matmul, [args.seq_len] * args.seqs)
        print(json.dumps({"step_s": step_s, "tokens_per_s": args.seqs * args.seq_len / step_s,
                          "flops_per_s": flops / step_s, "peak_rss_mb": peak_rss.item()}))
    close_process_groups()


def run(nproc: int, dtype: str, args) -> dict:
    return run_worker(__file__, nproc, [f"--dtype={dtype}", f"--steps={args.steps}", f"--seqs={args.seqs}",
                                        f"--seq-len={args.seq_len}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="only this dtype (default: float32, and bfloat16 where the CPU has native bf16 matmuls)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    dtypes = {"float32": torch.float32}
    if args.dtype == "bfloat16" or (args.dtype is None and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        dtypes["bfloat16"] = torch.bfloat16
    elif args.dtype is None:  # emulated bf16 runs ~100x slower than fp32: nothing to learn from timing it
        print("bf16: this CPU has no native bf16 matmul (AVX512-BF16 or AMX); bf16 rows skipped")
    if args.dtype:
        dtypes = {args.dtype: dtypes[args.dtype]}
    peaks = {name: matmul_peak(dtype) for name, dtype in dtypes.items()}
    print("matmul peak: " + ", ".join(f"{name} {peak / 1e9:.0f} GFLOP/s" for name, peak in peaks.items()))
    print(f"workload: SmolLM2-135M, {args.seqs} x {args.seq_len} tokens per step, median of {args.steps} steps")
    header = (f"{'dtype':<9} {'ranks':>5} {'step s':>7} {'tokens/s':>9} {'GFLOP/s':>8} {'% peak':>7} "
              f"{'peak RSS/rank MiB':>18}")
    print(header + "\n" + "-" * len(header))
    for dtype in dtypes:
        for nproc in (1, 2):
            r = run(nproc, dtype, args)
            print(f"{dtype:<9} {nproc:>5} {r['step_s']:>7.2f} {r['tokens_per_s']:>9.0f} {r['flops_per_s'] / 1e9:>8.1f} "
                  f"{100 * r['flops_per_s'] / peaks[dtype]:>6.1f}% {r['peak_rss_mb']:>18.0f}", flush=True)


if __name__ == "__main__":
    main()
