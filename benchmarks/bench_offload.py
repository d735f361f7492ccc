"""Moving a trained model's state off one GPU and back, as a colocated rollout does at every step:
page-locked host buffers (the default) against pageable memory (`RL2_PINNED_OFFLOAD=0`), with and
without transparent huge pages.

    python benchmarks/bench_offload.py [--size 0.5B|1.5B] [--rounds 4]

The model is Qwen2.5-shaped with random weights (as `bench_gpu.py` builds it): float32 master weights,
bf16 compute, AdamW after one step, so that parameters and both moments move. Each mode runs in a process
of its own: `--rounds` rounds of `offload()` then `onload()`. Per mode: the bytes moved, the first round's
seconds (it also allocates, and page-locks, the host memory), the median of the later rounds with their
GB/s, and the process's peak resident memory. Every mode checks that the weights come back unchanged.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_gpu import QWEN25, make_model  # noqa: E402

# Host memory of each mode: page-locked buffers; fresh pageable memory on huge pages (RL2's default for
# large CPU tensors, see RL2/__init__.py); and on 4 KB pages.
MODES = {"page-locked": {"RL2_PINNED_OFFLOAD": "1"},
         "pageable": {"RL2_PINNED_OFFLOAD": "0", "THP_MEM_ALLOC_ENABLE": "1"},
         "4 KB pages": {"RL2_PINNED_OFFLOAD": "0", "THP_MEM_ALLOC_ENABLE": "0"}}


def worker(args) -> dict:
    from RL2.batch import SequenceBatch
    from RL2.config.ppo_schema import ActorConfig
    from RL2.datasets.packing import pack, train_weights
    from RL2.models.logps import packed_logps
    from RL2.native import use_huge_pages
    from RL2.parallel import ParallelDims, init_distributed
    from RL2.workers.fsdp import FSDPWorker

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    device = torch.device("cuda", 0)
    init_distributed(device)
    w = FSDPWorker(ActorConfig(model_name=args.model, dtype="bfloat16"), ParallelDims(1, device_type="cuda"),
                   device, total_steps=2)
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 1000, (512,), generator=generator).tolist(), "loss_mask": [1] * 512}
            for _ in range(4)]
    sequences = SequenceBatch.from_examples(rows)
    for mb in pack(sequences, 0, 1, 4096, train_weights(sequences, "token")):
        mb = mb.to(device)
        w.backward(-(packed_logps(w.model, mb) * mb.loss_weights).sum())
    w.optimizer_step()
    moved_bytes = w.resident_bytes()["cuda"]
    checksum = lambda: [p.to_local().double().sum().item() for p in w.model.parameters()]
    before = checksum()
    offload, onload = [], []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        began = time.perf_counter()
        w.offload()
        torch.cuda.synchronize()
        offload.append(time.perf_counter() - began)
        began = time.perf_counter()
        w.onload()
        torch.cuda.synchronize()
        onload.append(time.perf_counter() - began)
    assert checksum() == before, "the weights changed on their way off the GPU and back"
    return {"bytes": moved_bytes, "offload": offload, "onload": onload,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def later(seconds: list[float]) -> float:
    """The median of the rounds after the first (which also allocates the host memory)."""
    return statistics.median(seconds[1:] or seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(QWEN25), default="0.5B")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_offload.py needs a CUDA GPU")
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        n_params = make_model(args.size, Path(folder))
        print(f"model: Qwen2.5-{args.size}-shaped, {n_params / 1e6:.0f}M parameters, float32 weights and AdamW "
              f"moments; {args.rounds} rounds of offload and onload")
        print(f"{'host memory':<12} {'GB moved':>8} {'1st off s':>9} {'1st on s':>8} {'off s':>7} {'off GB/s':>8} "
              f"{'on s':>7} {'on GB/s':>7} {'peak RSS GB':>11}")
        results = {}
        for mode, switches in MODES.items():
            env = {**os.environ, "PYTHONPATH": str(REPO), **switches}
            cmd = [sys.executable, __file__, "--worker", "--model", folder, "--rounds", str(args.rounds)]
            result = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"the {mode} worker failed:\n{result.stderr[-4000:]}")
            # A row as each mode finishes: each runs in a process of its own and takes tens of seconds.
            r = results[mode] = json.loads(result.stdout.strip().splitlines()[-1])
            gb = r["bytes"] / 1e9
            off, on = later(r["offload"]), later(r["onload"])
            print(f"{mode:<12} {gb:>8.2f} {r['offload'][0]:>9.3f} {r['onload'][0]:>8.3f} {off:>7.3f} {gb / off:>8.1f} "
                  f"{on:>7.3f} {gb / on:>7.1f} {r['peak_rss'] / 1e9:>11.2f}", flush=True)
    fast, slow = results["page-locked"], results["pageable"]
    per_round = lambda r: later(r["offload"]) + later(r["onload"])
    print(f"page-locked: {per_round(slow) / per_round(fast):.1f}x faster per round trip after the first")


if __name__ == "__main__":
    main()
