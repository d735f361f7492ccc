"""Trainer memory per rank and step time: LoRA against full fine-tuning of the embedded model.

    python benchmarks/bench_lora.py [--rank 16] [--seq-len 128] [--seqs 4] [--steps 2] [--dtype auto]

One SFT step (negative log-likelihood of `--seqs` sequences of `--seq-len` synthetic tokens, backward,
AdamW) of SmolLM2-135M-Instruct on 1 and 2 ranks (FSDP), with every parameter trained (the baseline) and
with LoRA adapters of rank `--rank` on the attention and MLP projections. Per rank: bytes of parameters
(float32 master weights; with LoRA a base in the compute dtype plus float32 adapters), gradients and
AdamW state, counted from the tensors after the steps; peak resident memory (which includes rank 0's
CPU copy of the checkpoint while it loads); median seconds per step after one warm-up step.
The ranks share the machine's cores (threads per rank = cores / ranks).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_sft_steps, run_worker  # noqa: E402


def worker(args) -> None:
    """Runs under torchrun: one mode, `args.steps` timed steps after a warm-up step."""
    import torch.distributed as dist

    from RL2.native import use_huge_pages
    from RL2.parallel import close_process_groups

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    model, figures = measure_sft_steps({"dtype": args.dtype, "max_length_per_device": args.seq_len * args.seqs,
                                        "lora": {"rank": args.lora_rank}}, args.seq_len, args.seqs, args.steps)
    trained = sum(p.numel() for p in model.model.parameters() if p.requires_grad)  # DTensors: full sizes
    if dist.get_rank() == 0:
        print(json.dumps({"trained": trained, **figures, "dtype": str(model.dtype).removeprefix("torch.")}))
    close_process_groups()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--seqs", type=int, default=4, help="sequences per step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute dtype (actor.dtype)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    flags = [f"--seq-len={args.seq_len}", f"--seqs={args.seqs}", f"--steps={args.steps}", f"--dtype={args.dtype}"]
    print(f"SFT step of SmolLM2-135M-Instruct, {args.seqs} x {args.seq_len} tokens; per rank, the most loaded one")
    print("| mode | ranks | compute dtype | trained params | params MiB | grads MiB | AdamW state MiB | "
          "params + grads + AdamW MiB | peak RSS MiB | s/step | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results = {}
    for nproc in (1, 2):
        for name, rank in (("full fine-tuning", 0), (f"LoRA r={args.rank}", args.rank)):
            r = run_worker(__file__, nproc, [*flags, f"--lora-rank={rank}"])
            results[name, nproc] = r
            state = r["params_mb"] + r["grads_mb"] + r["optim_mb"]
            print(f"| {name} | {nproc} | {r['dtype']} | {r['trained'] / 1e6:.2f} M | {r['params_mb']:.0f} | "
                  f"{r['grads_mb']:.1f} | {r['optim_mb']:.1f} | {state:.0f} | {r['peak_rss_mb']:.0f} | "
                  f"{r['step_s']:.2f} | {r['tokens_per_s']:.0f} |", flush=True)
    print()
    for nproc in (1, 2):
        full, lora = results["full fine-tuning", nproc], results[f"LoRA r={args.rank}", nproc]
        state = [r["params_mb"] + r["grads_mb"] + r["optim_mb"] for r in (full, lora)]
        print(f"{nproc} rank(s): LoRA holds {state[1] / state[0]:.0%} of full fine-tuning's parameters, gradients "
              f"and AdamW state, peaks at {lora['peak_rss_mb'] / full['peak_rss_mb']:.0%} of its resident memory, and "
              f"steps in {lora['step_s'] / full['step_s']:.0%} of its time")


if __name__ == "__main__":
    main()
