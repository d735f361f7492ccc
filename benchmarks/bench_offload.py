"""Moving a trained model's state off one GPU and back, as a colocated rollout does at every step:
page-locked host buffers (the default) against pageable memory (`RL2_PINNED_OFFLOAD=0`), with and
without transparent huge pages.

    python benchmarks/bench_offload.py [--size 0.5B|1.5B] [--rounds 4] [--device cpu]

The model is Qwen2.5-shaped with random weights (as `bench_gpu.py` builds it): float32 master weights,
bf16 compute, AdamW after one step, so that parameters and both moments move. Each mode runs in a process
of its own: `--rounds` rounds of `offload()` then `onload()`. Per mode: the bytes moved, the first round's
seconds (it also allocates, and page-locks, the host memory), the median of the later rounds with their
GB/s, and the process's peak resident memory. Every mode checks that the weights come back unchanged,
and the page-locked mode that every large tensor sat in page-locked memory while offloaded.
`--device cpu` checks the script itself with a tiny model: the page-locked mode's moves on the CPU into
buffers whose locking is recorded (nothing is offloaded from a CPU, so the pageable modes do not run);
no figures.
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
    from RL2.models.logps import packed_logps
    from RL2.native import use_huge_pages
    from RL2.packing import pack, train_weights
    from RL2.parallel import ParallelDims, init_distributed
    from RL2.workers.fsdp import FSDPWorker

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    init_distributed(device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    w = FSDPWorker(ActorConfig(model_name=args.model, dtype=dtype), ParallelDims(1, device_type=device.type),
                   device, total_steps=2)
    locked = recording_lock(w) if device.type == "cpu" else None
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 1000, (512,), generator=generator).tolist(), "loss_mask": [1] * 512}
            for _ in range(4)]
    sequences = SequenceBatch.from_examples(rows)
    for mb in pack(sequences, 0, 1, 4096, train_weights(sequences, "token")):
        mb = mb.to(device)
        w.backward(-(packed_logps(w.model, mb) * mb.loss_weights).sum())
    w.optimizer_step()
    moved_bytes = w.resident_bytes()[device.type]
    checksum = lambda: [p.to_local().double().sum().item() for p in w.model.parameters()]
    before = checksum()
    offload, onload = [], []
    for _ in range(args.rounds):
        synchronize(device)
        began = time.perf_counter()
        w.offload()
        synchronize(device)
        offload.append(time.perf_counter() - began)
        if os.environ.get("RL2_PINNED_OFFLOAD") != "0":
            check_locked(w, locked)
        began = time.perf_counter()
        w.onload()
        synchronize(device)
        onload.append(time.perf_counter() - began)
    assert checksum() == before, "the weights changed on their way off the GPU and back"
    return {"bytes": moved_bytes, "offload": offload, "onload": onload,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def recording_lock(w) -> dict[int, int]:
    """On the CPU: `w` offloads into host buffers whose page-locking is recorded, not done (CUDA locks them);
    returns the address -> bytes of the ranges locked now."""
    from RL2.native import PinnedHostCopies

    locked: dict[int, int] = {}
    w.offload_into(PinnedHostCopies(lock=locked.__setitem__, unlock=locked.pop))
    return locked


def check_locked(w, locked: dict[int, int] | None) -> None:
    """Every large offloaded tensor in page-locked memory: as CUDA sees it (`is_pinned`), or on the CPU
    with its storage's first byte in a recorded range, which is what `is_pinned` asks CUDA about."""
    tensors = [p.to_local() for p in w.model.parameters()]
    tensors += [v.to_local() for s in w.optimizer.state.values() for v in s.values() if v.dim() > 0]
    large = [t for t in tensors if t.numel() * t.element_size() >= 2**20]
    if locked is None:
        pageable = [t for t in large if not t.is_pinned()]
    else:
        pageable = [t for t in large if not any(a <= t.untyped_storage().data_ptr() < a + n for a, n in locked.items())]
    # (An unevenly sharded tensor stays pageable by design, `takes_buffer`; at one rank none is.)
    assert large and not pageable, f"{len(pageable)} of {len(large)} large offloaded tensors are not page-locked"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def later(seconds: list[float]) -> float:
    """The median of the rounds after the first (which also allocates the host memory)."""
    return statistics.median(seconds[1:] or seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(QWEN25), default="0.5B")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a check of this script with a tiny model, no figures")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.rounds < 2:
        sys.exit(f"--rounds {args.rounds}: give at least 2 (the first round also allocates the host memory)")
    modes = MODES
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_offload.py needs a CUDA GPU (--device cpu checks the script)")
        print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    else:
        args.size, modes = "smoke", {"page-locked": MODES["page-locked"]}
    with tempfile.TemporaryDirectory() as folder:
        n_params = make_model(args.size, Path(folder))
        print(f"model: Qwen2.5-{args.size}-shaped, {n_params / 1e6:.0f}M parameters, float32 weights and AdamW "
              f"moments; {args.rounds} rounds of offload and onload")
        print(f"{'host memory':<12} {'GB moved':>8} {'1st off s':>9} {'1st on s':>8} {'off s':>7} {'off GB/s':>8} "
              f"{'on s':>7} {'on GB/s':>7} {'peak RSS GB':>11}")
        results = {}
        for mode, switches in modes.items():
            env = {**os.environ, "PYTHONPATH": str(REPO), **switches}
            cmd = [sys.executable, __file__, "--worker", "--model", folder, "--rounds", str(args.rounds),
                   "--device", args.device]
            result = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"the {mode} worker failed:\n{result.stderr[-4000:]}")
            # A row as each mode finishes: each runs in a process of its own and takes tens of seconds.
            r = results[mode] = json.loads(result.stdout.strip().splitlines()[-1])
            gb = r["bytes"] / 1e9
            off, on = later(r["offload"]), later(r["onload"])
            print(f"{mode:<12} {gb:>8.2f} {r['offload'][0]:>9.3f} {r['onload'][0]:>8.3f} {off:>7.3f} {gb / off:>8.1f} "
                  f"{on:>7.3f} {gb / on:>7.1f} {r['peak_rss'] / 1e9:>11.2f}", flush=True)
    if "pageable" in results:
        fast, slow = results["page-locked"], results["pageable"]
        per_round = lambda r: later(r["offload"]) + later(r["onload"])
        print(f"page-locked: {per_round(slow) / per_round(fast):.1f}x faster per round trip after the first")


if __name__ == "__main__":
    main()
