"""The micro-batch loop every trainer and worker shares.

A global batch is packed into micro-batches, each rank its share (`RL2.datasets.packing.pack`). Every
micro-batch's loss is already weighted for the whole global batch (`RL2.algs.averaging`), so the
losses of all micro-batches of all ranks add up to the batch's loss and their gradients to its
gradient: FSDP sums the ranks' gradients as they are (`FSDPWorker` switches its averaging off once),
and no call site scales a loss.
"""

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from RL2.batch import MicroBatch
from RL2.parallel import ParallelDims

# (micro-batch on the device) -> (its loss, already weighted for the global batch; metric partial sums)
LossFn = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor | float]]]


def run_micro_batches(worker, micro_batches: list[MicroBatch], loss_fn: LossFn, train: bool = True) -> dict[str, float]:
    """Forward (and, when training, backward) every micro-batch of this rank.

    Args:
        worker: the `FSDPWorker` being trained or evaluated (its `backward` applies a gradient scaler
            when there is one).
        micro_batches: this rank's share of the global batch.
        loss_fn: the loss and metric partial sums of one micro-batch.
        train: backward each loss; False runs without autograd.

    Returns:
        Each metric summed over this rank's micro-batches (`sum_over_data_ranks` completes the sum).
    """
    totals = defaultdict(float)
    for mb in micro_batches:
        mb = mb.to(worker.device)
        with torch.set_grad_enabled(train):
            loss, metrics = loss_fn(mb)
        if train:
            worker.backward(loss)
        for key, value in metrics.items():
            totals[key] += float(value)
    return dict(totals)


def sum_over_data_ranks(totals: dict[str, float], dims: ParallelDims, device: torch.device) -> dict[str, float]:
    """Per-rank sums -> sums over the whole global batch. Ranks that differ only in cp or tp hold the same
    sums, so they are added over the data-parallel group alone. Collective."""
    group = dims.dp_mesh.get_group()
    # A rank whose share was only padding has no metrics of its own: agree on the keys first.
    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, sorted(totals), group=group)
    keys = sorted(set().union(*names))
    summed = torch.tensor([totals.get(key, 0.0) for key in keys], dtype=torch.float64, device=device)
    dist.all_reduce(summed, group=group)
    return dict(zip(keys, summed.tolist()))
