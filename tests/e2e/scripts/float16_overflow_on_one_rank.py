"""A float16 LoRA model under tp=2 whose gradient overflows in one rank's shard only.

    torchrun --nproc_per_node=2 tests/e2e/scripts/float16_overflow_on_one_rank.py MODEL

After one backward, rank 1 writes inf into its shard of a column-parallel `lora_B` (as an fp16
weight-gradient product that overflows on that rank's slice of the outputs would); the LoRA model's
first trained parameter, `lora_A` of the same layer, is replicated over tp. The optimizer step must be
skipped on every rank alike. Rank 0 prints one JSON line: every rank's loss scale, whether the
optimizer stepped (it keeps state then) and whether any trained parameter changed.
"""

import json
import sys

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from RL2.batch import SequenceBatch
from RL2.config.schema import ModelConfig
from RL2.models.logps import packed_logps
from RL2.packing import pack, train_weights
from RL2.parallel import ParallelDims, close_process_groups, init_distributed, pick_device, shard_of
from RL2.workers.fsdp import FSDPWorker

OVERFLOWING = "model.layers.0.self_attn.q_proj.lora_B.weight"


def main(model_path: str) -> None:
    device = pick_device("cpu")
    init_distributed(device)
    torch.manual_seed(0)
    dims = ParallelDims(dist.get_world_size(), tp=2, device_type=device.type)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "model_name": model_path, "dtype": "float16", "tp_size": 2, "optimizer": {"lr": 1e-3},
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}})
    worker = FSDPWorker(cfg, dims, device, total_steps=10)
    generator = torch.Generator().manual_seed(0)
    batch = SequenceBatch.from_examples([{"input_ids": torch.randint(0, 1000, (n,), generator=generator).tolist(),
                                          "loss_mask": [0] * 3 + [1] * (n - 3)} for n in (20, 33, 9)])
    for mb in pack(batch, dims.dp_rank, dims.dp, 4096, train_weights(batch, "token"), seq_parallel=dims.seq_parallel):
        worker.backward(-(packed_logps(worker.model, mb.to(device)) * mb.loss_weights).sum())
    params = dict(worker.model.named_parameters())
    if dist.get_rank() == 1:
        shard_of(params[OVERFLOWING].grad).view(-1)[0] = float("inf")
    trained = {name: shard_of(p).clone() for name, p in params.items() if p.requires_grad}
    worker.optimizer_step()
    report = {"scale": worker.scaler.get_scale(), "stepped": bool(worker.optimizer.state),
              "changed": any(not torch.equal(value, shard_of(params[name])) for name, value in trained.items())}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print(json.dumps({"first_trained": next(n for n, p in params.items() if p.requires_grad), "ranks": reports}))
    close_process_groups()


if __name__ == "__main__":
    main(sys.argv[1])
