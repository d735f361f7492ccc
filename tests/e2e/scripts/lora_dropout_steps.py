"""Two optimizer steps of a LoRA model with adapter dropout on column-parallel layers; saves every rank's
copy of each adapter.

    torchrun --nproc_per_node=N tests/e2e/scripts/lora_dropout_steps.py MODEL OUT.pt TP [save|load CKPT]

Under tensor parallelism a column-parallel layer's input, and so the dropout mask of its adapter, is
the same on every tp rank; lora_A is replicated over them. Rank 0 saves, for each run,
`{rank: {name: local tensor}}` for every rank and the full adapters: run on one process and under tp=2
they must agree.

`save CKPT`: one step, then a checkpoint (step1 in CKPT) instead of the two steps; `load CKPT`: after the
two steps from the start (OUT's "fresh"), a second model resumes from it and takes two steps ("resumed").
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from RL2.batch import SequenceBatch
from RL2.config.schema import ModelConfig
from RL2.models.logps import packed_logps
from RL2.packing import pack, train_weights
from RL2.parallel import ParallelDims, close_process_groups, init_distributed, pick_device, shard_of
from RL2.utils.checkpoint import load_checkpoint, save_checkpoint
from RL2.workers.fsdp import FSDPWorker


def train(cfg, dims, device, steps: int, resume_from: str | None = None) -> FSDPWorker:
    torch.manual_seed(0)
    worker = FSDPWorker(cfg, dims, device, total_steps=10)
    generator = torch.Generator().manual_seed(0)
    batch = SequenceBatch.from_examples([{"input_ids": torch.randint(0, 1000, (n,), generator=generator).tolist(),
                                          "loss_mask": [0] * 3 + [1] * (n - 3)} for n in (20, 33, 9)])
    if resume_from is not None:
        load_checkpoint(Path(resume_from) / "step1", {"actor": worker}, rng_group=dims.tp_mesh.get_group())
    for _ in range(steps):
        for mb in pack(batch, dims.dp_rank, dims.dp, 4096, train_weights(batch, "token"),
                       seq_parallel=dims.seq_parallel):
            worker.backward(-(packed_logps(worker.model, mb.to(device)) * mb.loss_weights).sum())
        worker.optimizer_step()
    return worker


def adapters(worker: FSDPWorker) -> dict:
    local = {name: shard_of(p).detach().clone() for name, p in worker.model.named_parameters() if p.requires_grad}
    copies = [None] * dist.get_world_size()
    dist.all_gather_object(copies, local)
    full = {name: tensor for name, tensor in worker.full_state_dict().items() if "lora_" in name}
    return {"copies": copies, "full": full}


def main(model_path: str, out: str, tp: int, mode: str | None = None, folder: str | None = None) -> None:
    device = pick_device("cpu")
    init_distributed(device)
    dims = ParallelDims(dist.get_world_size(), tp=tp, device_type=device.type)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "model_name": model_path, "dtype": "float32", "tp_size": tp, "optimizer": {"lr": 1e-3},
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.5, "target_modules": ["q_proj", "v_proj", "o_proj"]}})
    if mode == "save":
        save_checkpoint(folder, 1, {"actor": train(cfg, dims, device, steps=1)}, {})
    else:
        runs = {"fresh": adapters(train(cfg, dims, device, steps=2))}
        if mode == "load":
            runs["resumed"] = adapters(train(cfg, dims, device, steps=2, resume_from=folder))
        if dist.get_rank() == 0:
            torch.save(runs, out)
    close_process_groups()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:6])
