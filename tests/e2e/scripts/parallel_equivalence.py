"""One training step of a tiny model under several parallel layouts, in one torchrun launch.

    torchrun --nproc_per_node=N tests/e2e/scripts/parallel_equivalence.py OUT.pt MODEL@tp=2,cp=1,ddp=1,ac=0 ...

For each layout: pack the fixed examples of `examples()`, compute per-token log-probs and entropies,
backward an SFT loss plus an entropy bonus (token average over the global batch), record the full
gradients, take one AdamW step, and record the weights the engine would receive (`full_tensors`) and
the exported state dict. Rank 0 saves every layout's results; the test compares them with a plain
single-process computation.
"""

import sys

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from RL2.batch import SequenceBatch
from RL2.config.schema import ModelConfig
from RL2.models.logps import forward_packed
from RL2.packing import pack, train_weights
from RL2.parallel import ParallelDims, close_process_groups, init_distributed, pick_device
from RL2.workers.fsdp import FSDPWorker, full_tensors

LENGTHS = (70, 12, 25, 33, 8, 19)  # the 70-token example exceeds one rank's budget under cp=2
BUDGET = 80  # tokens of one micro-batch, whatever the layout: max_length_per_device = BUDGET // (cp * tp)
ENTROPY_COEF = 0.1
LR = 1e-3
EPS = 1e-3  # Adam with a tiny eps moves near-zero gradients by ~lr whatever their round-off


def examples(vocab: int = 1000) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in LENGTHS:
        prompt = n // 3
        rows.append({"input_ids": torch.randint(0, vocab, (n,), generator=generator).tolist(),
                     "loss_mask": [0] * prompt + [1] * (n - prompt)})
    return rows


def model_config(path: str, tp: int, cp: int, ddp: int):
    cfg = OmegaConf.structured(ModelConfig)
    cfg.merge_with({"model_name": path, "dtype": "float32", "tp_size": tp, "cp_size": cp, "ddp_size": ddp,
                    "max_length_per_device": BUDGET // (cp * tp), "max_grad_norm": 1.0,
                    "optimizer": {"lr": LR, "eps": EPS}})
    return cfg


def run_layout(spec: str, device: torch.device) -> dict | None:
    path, degrees = spec.split("@")
    degrees = {k: int(v) for k, v in (item.split("=") for item in degrees.split(","))}
    tp, cp, ddp = degrees.get("tp", 1), degrees.get("cp", 1), degrees.get("ddp", 1)
    checkpointing = bool(degrees.get("ac", 0))  # ac=1: recompute activations in backward
    trained_only = bool(degrees.get("trained", 0))  # trained=1: logits at trained tokens only
    dims = ParallelDims(dist.get_world_size(), tp=tp, cp=cp, ddp=ddp, device_type=device.type)
    dims.build_mesh()
    cfg = model_config(path, tp, cp, ddp)
    cfg.enable_gradient_checkpointing = checkpointing
    worker = FSDPWorker(cfg, dims, device, total_steps=10)
    batch = SequenceBatch.from_examples(examples())
    micro = pack(batch, dims.dp_rank, dims.dp, cfg.max_length_per_device, train_weights(batch, "token"),
                 seq_parallel=dims.seq_parallel)
    local, loss_sum = {}, 0.0
    for mb in micro:
        mb = mb.to(device)
        out = forward_packed(worker.model, mb, trained_only=trained_only)
        logps, entropy = out.logps_and_entropy(entropy_grad=True)
        loss = ((-logps - ENTROPY_COEF * entropy) * mb.loss_weights).sum()
        loss.backward()
        loss_sum += loss.item()
        for index, lp, ent in zip(mb.sequence_ids, mb.unpack(logps.detach()), mb.unpack(entropy.detach())):
            local[index] = (lp, ent)
    parts = [None] * dims.dp
    dist.all_gather_object(parts, local, group=dims.dp_mesh.get_group())
    merged = {k: v for part in parts for k, v in part.items()}
    total = torch.tensor([loss_sum], dtype=torch.float64)
    dist.all_reduce(total, group=dims.dp_mesh.get_group())
    # Cloned: on a mesh of one rank full_tensor() may return the gradient itself, which clipping scales in place.
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for name, p in worker.model.named_parameters()}
    stats = worker.optimizer_step()
    synced = dict(full_tensors(worker.model, torch.float32))
    exported = worker.full_state_dict()
    if dist.get_rank() != 0:
        return None
    return {
        "loss": total.item(), "grad_norm": stats["grad_norm"], "micro_batches": len(micro),
        "max_length_per_device": cfg.max_length_per_device, "fsdp": dims.fsdp,
        "logps": [merged[i][0] for i in range(len(batch))], "entropy": [merged[i][1] for i in range(len(batch))],
        "grads": grads, "synced": synced, "exported": exported,
    }


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    device = pick_device("cpu")
    init_distributed(device)
    torch.manual_seed(0)
    results = {spec: run_layout(spec, device) for spec in specs}
    if dist.get_rank() == 0:
        torch.save(results, out)
    close_process_groups()


if __name__ == "__main__":
    main()
