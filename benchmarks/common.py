"""What the benchmarks share: the matmul peak and memory bandwidth they compare against, launching a
worker on N ranks, and running with a CPU's older instruction sets only."""

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# The environment that keeps torch's kernels, MKL, oneDNN and RL2's C libraries to the instructions an
# x86 CPU of that kind has: `--isa avx2` on an AVX512 host runs the code an AVX2 CPU runs (at this host's
# clocks and memory speed, so the figures are a proxy for that CPU, not its own).
ISA_ENVIRONMENTS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "RL2_MARCH": "x86-64-v3"},
}


def add_isa_argument(parser) -> None:
    parser.add_argument("--isa", default="native", choices=list(ISA_ENVIRONMENTS),
                        help="instruction sets: native (all this CPU has), or avx2 (what an AVX2 CPU runs)")


def run_with_isa(isa: str) -> None:
    """Restart this script with `ISA_ENVIRONMENTS[isa]` set, unless it already is: the libraries read
    these variables once, when they first run, so they must be set before this process uses torch (and
    they pass to every process the script starts)."""
    wanted = ISA_ENVIRONMENTS[isa]
    if any(os.environ.get(key) != value for key, value in wanted.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | wanted)


# AMD's CPU families by the cores they bring (the model name of a cloud VM's CPU often says only "AMD EPYC").
AMD_FAMILIES = {23: "Zen 1/2", 25: "Zen 3/4", 26: "Zen 5"}


def cpu_kind() -> str:
    """The CPU as a figure must name it: model name, AMD's core generation, the instruction sets that RL2's kernels
    and `dtype=auto` choose by, and the cores this process may use."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    name = fields.get("model name", "unknown CPU")
    if fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family", "").isdigit():
        family = int(fields["cpu family"])
        generation = AMD_FAMILIES.get(family, "Zen")
        if family == 25:
            generation = "Zen 4" if "avx512f" in flags else "Zen 3"
        name += f" ({generation}, family {family})"
    isa = ("AMX" if "amx_tile" in flags else "no AMX", "AVX512-BF16" if "avx512_bf16" in flags else None,
           "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    return f"{name}, {', '.join(part for part in reversed(isa) if part)}, {len(os.sched_getaffinity(0))} cores"


def matmul_peak(dtype: torch.dtype, n: int = 2048, rounds: int = 5, repeats: int = 4) -> float:
    """FLOP/s of a square matmul with every core (what a training step could hope for): the best of
    several rounds, as a busy moment on a shared machine only ever slows a round down."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - began))
    return best


def memory_bandwidth(megabytes: int = 512, rounds: int = 5) -> float:
    """Bytes/s every core together reads from memory (a float32 sum over a buffer far larger than the
    caches): the roofline's other side. The best of several rounds, as for `matmul_peak`."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    buffer.sum()
    best = 0.0
    for _ in range(rounds):
        began = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.nbytes / (time.perf_counter() - began))
    return best


def run_worker(script: str, nproc: int, flags: list[str]) -> dict:
    """Run `script --worker FLAGS` on `nproc` ranks (the cores split between them); returns the JSON
    object the worker prints last. Where the ranks fail, ends the benchmark after their errors, which
    show as they come (only their standard output is read)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script, "--worker", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(max(1, os.cpu_count() // nproc))}
    result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if result.returncode:
        sys.exit(f"{Path(script).name} --worker {' '.join(flags)} on {nproc} ranks failed (exit code "
                 f"{result.returncode}): the ranks' errors are above")
    return json.loads(result.stdout.strip().splitlines()[-1])


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of the given (possibly distributed) tensors."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (Linux /proc)."""
    pids, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        pids.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    frontier += [int(child) for child in f.read().split()]
        except OSError:
            pass  # it has just exited
    return pids


def resident_kinds(pid: int) -> tuple[int, int, int]:
    """Bytes of a process's resident memory: (anonymous, file-backed, shared memory), from the kernel's
    counters in /proc/PID/status (reading them costs microseconds; /proc/PID/smaps_rollup, which gives
    the proportional set size, walks the page tables: ~70 ms for a 5 GB rank, taken from the CPU and
    the memory map lock that the measured run needs)."""
    fields = {"RssAnon:": 0, "RssFile:": 0, "RssShmem:": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(maxsplit=1)[0] if line.strip() else ""
                if key in fields:
                    fields[key] = int(line.split()[1]) * 1024
    except OSError:
        pass  # it has just exited
    return fields["RssAnon:"], fields["RssFile:"], fields["RssShmem:"]


def tree_memory(pids: list[int]) -> int:
    """Bytes a set of processes holds: anonymous memory (each process's own) summed, and file-backed and
    shared memory (libraries, the /dev/shm segments the ranks exchange shards through, which every rank
    maps) counted once, as the most any one process maps."""
    kinds = [resident_kinds(pid) for pid in pids]
    return sum(a for a, _, _ in kinds) + max((f for _, f, _ in kinds), default=0) + max(
        (s for _, _, s in kinds), default=0)


class PeakMemory:
    """The most memory a process tree (a launcher and its ranks) held at once, sampled every `interval` s.

        with PeakMemory(process.pid) as memory:
            process.wait()
        memory.peak_gb
    """

    def __init__(self, root: int, interval: float = 0.1):
        self.root, self.interval, self.peak_bytes = root, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, tree_memory(process_tree(self.root)))
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / 1e9


def run_measured(command: list[str], env: dict | None = None, cwd: Path = REPO, stdout=None) -> float:
    """Run a command to its end (raising if it fails), its output to `stdout` (a file; None: ours); the
    most memory (GB) its process tree held at once."""
    process = subprocess.Popen(command, cwd=cwd, env=os.environ | (env or {}), stdout=stdout)
    with PeakMemory(process.pid) as memory:
        if process.wait():
            raise subprocess.CalledProcessError(process.returncode, command)
    return memory.peak_gb


def measure_sft_steps(overrides: dict, seq_len: int, seqs: int, steps: int):
    """Under torchrun: an `FSDPWorker` of the default model with `overrides` (ModelConfig fields), trained
    for `steps` SFT steps (the NLL of `seqs` random sequences of `seq_len` tokens) after a warm-up step.

    Returns:
        (the worker, the figures of the most loaded rank: `params_mb`, `grads_mb`, `optim_mb` (this
        rank's share of each), `peak_rss_mb`, and the median `step_s` and `tokens_per_s`). Every rank
        gets the same figures.
    """
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from RL2.batch import SequenceBatch
    from RL2.config.schema import ModelConfig
    from RL2.models.logps import packed_logps
    from RL2.native import use_huge_pages
    from RL2.packing import pack, train_weights
    from RL2.parallel import ParallelDims, init_distributed, pick_device
    from RL2.workers.fsdp import FSDPWorker

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    device = pick_device("cpu")
    init_distributed(device)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), overrides)
    dims = ParallelDims.from_config(cfg, device)
    dims.build_mesh()
    model = FSDPWorker(cfg, dims, device, total_steps=100)
    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(0, 49152, (seq_len + 1,), generator=generator).tolist(),
                 "loss_mask": [1] * (seq_len + 1)} for _ in range(seqs)]
    batch = SequenceBatch.from_examples(examples)
    micro = pack(batch, dims.dp_rank, dims.dp, cfg.max_length_per_device, train_weights(batch, "token"),
                 seq_parallel=dims.seq_parallel)
    times, grad_bytes = [], 0
    for _ in range(steps + 1):  # the first step warms up
        dist.barrier()
        began = time.perf_counter()
        for mb in micro:
            model.backward(-(packed_logps(model.model, mb) * mb.loss_weights).sum())
        grad_bytes = local_bytes(p.grad for p in model.model.parameters() if p.grad is not None)
        model.optimizer_step()
        dist.barrier()
        times.append(time.perf_counter() - began)
    state = [v for s in model.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    figures = torch.tensor([local_bytes(model.model.parameters()), grad_bytes, local_bytes(state),
                            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the most loaded rank
    step_s = sorted(times[1:])[len(times[1:]) // 2]
    mb = [x / 2**20 for x in figures.tolist()]
    return model, {"params_mb": mb[0], "grads_mb": mb[1], "optim_mb": mb[2], "peak_rss_mb": mb[3],
                   "step_s": step_s, "tokens_per_s": seqs * seq_len / step_s}
