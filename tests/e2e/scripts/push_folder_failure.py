"""Two ranks push weights to SGLang through a folder, and the writing rank's disk fills up mid-write
(a file-size limit: the write fails with EFBIG). Each rank writes what it raised, as JSON, to
`<folder>/rank<N>.json` (ranks printing at once could share a line of torchrun's output)."""

import json
import resource
import signal
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from RL2.engine.sglang.engine import SGLangEngine


def full_tensors():
    """Like `RL2.workers.fsdp.full_tensors`: every tensor comes from an all-gather of every rank."""
    for i, n in enumerate([16, 16, 4096, 4096]):
        parts = [torch.empty(n) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, torch.full((n,), float(dist.get_rank())))
        yield f"layer{i}.weight", torch.cat(parts)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Only what `_push_folder` reads before it would call the servers: no server stands behind it.
    engine = object.__new__(SGLangEngine)
    engine.weights_dir = Path(tempfile.mkdtemp()) if rank == 0 else None  # rank 0 writes for the host
    engine.model_path, engine.bucket_bytes, engine.weights_dirs, engine._folder = sys.argv[1], 1, [], None
    if rank == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    try:
        engine._push_folder(full_tensors(), "step1")
        raised = None
    except Exception as e:  # noqa: BLE001 (the test reads which)
        raised = f"{type(e).__name__}: {e}"
    Path(sys.argv[2], f"rank{rank}.json").write_text(json.dumps({"rank": rank, "raised": raised}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
