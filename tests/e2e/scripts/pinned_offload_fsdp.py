"""Two gloo ranks: an FSDP2 model whose first layer has 513 rows (sharded 257 + 256, so FSDP pads the
second shard) moves its parameters and Adam moments into locked-page buffers after every step, and
takes the same steps as the same model that never moves. The padded shard, which FSDP copies into
fresh padded memory at every move, stays out of the buffers; its moments go in."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from RL2.native.pinned_host import PinnedHostCopies, state_to_host
from RL2.parallel import close_process_groups
from tests.helpers.recording_lock import RecordingLock


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 513), torch.nn.Tanh(), torch.nn.Linear(513, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


dist.init_process_group("gloo")
rank = dist.get_rank()
(moved, moved_optimizer), (still, still_optimizer) = build(), build()
recorder = RecordingLock()
copies = PinnedHostCopies(lock=recorder.lock, unlock=recorder.unlock)
x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(rank))
for _ in range(3):
    step(moved, moved_optimizer, x)
    step(still, still_optimizer, x)
    state_to_host(copies, moved, moved_optimizer)
weight = moved[0].weight
assert weight.to_local().shape[0] == (257 if rank == 0 else 256)
assert recorder.holds(weight.to_local()) == (rank == 0)
moments = [v.to_local() for v in moved_optimizer.state[weight].values() if v.dim() > 0]
assert len(moments) == 2 and all(recorder.holds(m) for m in moments)
assert recorder.calls == (3 if rank == 0 else 2)  # locked once, at the first move
for a, b in zip(moved.parameters(), still.parameters()):
    assert torch.equal(a.full_tensor(), b.full_tensor())
close_process_groups()
print("ok")
