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
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import local_bytes, run_worker  # noqa: E402


def worker(args) -> None:
    """Runs under torchrun: one mode, `args.steps` timed steps after a warm-up step."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from RL2.batch import SequenceBatch
    from RL2.config.schema import ModelConfig
    from RL2.datasets.packing import pack, train_weights
    from RL2.models.logps import packed_logps
    from RL2.parallel import ParallelDims, init_distributed, pick_device
    from RL2.workers.fsdp import FSDPWorker

    device = pick_device("cpu")
    init_distributed(device)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "dtype": args.dtype, "max_length_per_device": args.seq_len * args.seqs, "lora": {"rank": args.lora_rank}})
    dims = ParallelDims.from_config(cfg, device)
    dims.build_mesh()
    model = FSDPWorker(cfg, dims, device, total_steps=100)
    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(0, 49152, (args.seq_len + 1,), generator=generator).tolist(),
                 "loss_mask": [1] * (args.seq_len + 1)} for _ in range(args.seqs)]
    batch = SequenceBatch.from_examples(examples)
    micro = pack(batch, dims.dp_rank, dims.dp, cfg.max_length_per_device, train_weights(batch, "token"))
    times, grad_bytes = [], 0
    for _ in range(args.steps + 1):  # the first step warms up
        dist.barrier()
        began = time.perf_counter()
        for mb in micro:
            model.backward(-(packed_logps(model.model, mb) * mb.loss_weights).sum())
        grad_bytes = local_bytes(p.grad for p in model.model.parameters() if p.grad is not None)
        model.optimizer_step()
        dist.barrier()
        times.append(time.perf_counter() - began)
    state = [v for s in model.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    trained = sum(p.numel() for p in model.model.parameters() if p.requires_grad)  # DTensors: full sizes
    figures = torch.tensor([local_bytes(model.model.parameters()), grad_bytes, local_bytes(state),
                            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the most loaded rank
    step_s = sorted(times[1:])[len(times[1:]) // 2]
    if dist.get_rank() == 0:
        mb = [x / 2**20 for x in figures.tolist()]
        print(json.dumps({"trained": trained, "params_mb": mb[0], "grads_mb": mb[1], "optim_mb": mb[2],
                          "peak_rss_mb": mb[3], "step_s": step_s, "tokens_per_s": args.seqs * args.seq_len / step_s,
                          "dtype": str(model.dtype).removeprefix("torch.")}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--seqs", type=int, default=4, help="sequences per step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--dtype", default="auto", help="compute dtype (actor.dtype)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    flags = [f"--seq-len={args.seq_len}", f"--seqs={args.seqs}", f"--steps={args.steps}", f"--dtype={args.dtype}"]
    print(f"SFT step of SmolLM2-135M-Instruct, {args.seqs} x {args.seq_len} tokens; per rank, the most loaded one")
    print("| mode | ranks | compute dtype | trained params | params MB | grads MB | AdamW state MB | "
          "params + grads + AdamW MB | peak RSS MB | s/step | tokens/s |")
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
