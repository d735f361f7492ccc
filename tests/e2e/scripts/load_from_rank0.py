"""Load a trained and a frozen model from rank 0 on 2 ranks, recording what the broadcast materialises.

    torchrun --nproc_per_node=2 tests/e2e/scripts/load_from_rank0.py MODEL OUT.pt DTYPE

Every `dist.broadcast` made while the weights are handed out (inside `set_model_state_dict`) is
recorded: the size of its tensor and how many tensors of earlier broadcasts were still alive then.
Rank 0 saves the full weights of both models (gathered from the shards) and the records of every rank.
"""

import sys
import weakref

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import RL2.workers.fsdp as fsdp
from RL2.config.schema import ModelConfig
from RL2.parallel import ParallelDims, close_process_groups, init_distributed, pick_device

SET_MODEL_STATE_DICT = fsdp.set_model_state_dict


class BroadcastRecorder:
    """Wraps `dist.broadcast` while active: the numel of each broadcast tensor, and how many tensors of
    earlier broadcasts were still referenced (alive) when it started."""

    def __init__(self):
        self.records: list[tuple[int, int]] = []
        self._earlier: list[weakref.ref] = []
        self._original = dist.broadcast

    def __call__(self, tensor, *args, **kwargs):
        alive = sum(ref() is not None for ref in self._earlier)
        self.records.append((tensor.numel(), alive))
        self._earlier.append(weakref.ref(tensor))
        return self._original(tensor, *args, **kwargs)


def recording(set_state, recorder: BroadcastRecorder):
    def wrapped(*args, **kwargs):
        dist.broadcast = recorder
        try:
            return set_state(*args, **kwargs)
        finally:
            dist.broadcast = recorder._original

    return wrapped


def main(model_path: str, out: str, dtype: str) -> None:
    device = pick_device("cpu")
    init_distributed(device)
    dims = ParallelDims(dist.get_world_size(), device_type=device.type)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"model_name": model_path, "dtype": dtype})
    results = {}
    for name, train in (("trained", True), ("frozen", False)):
        recorder = BroadcastRecorder()
        fsdp.set_model_state_dict = recording(SET_MODEL_STATE_DICT, recorder)
        worker = fsdp.FSDPWorker(cfg, dims, device, total_steps=1, train=train)
        full = {key: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for key, p in worker.model.named_parameters()}
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, recorder.records)
        buffers = {key: b.clone() for key, b in worker.model.named_buffers()}
        local_numel = sum(p.to_local().numel() for p in worker.model.parameters())
        results[name] = {"params": full, "buffers": buffers, "records": records, "local_numel": local_numel}
    if dist.get_rank() == 0:
        torch.save(results, out)
    close_process_groups()


if __name__ == "__main__":
    main(*sys.argv[1:4])
