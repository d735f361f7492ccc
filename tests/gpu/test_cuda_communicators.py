"""NCCL communicators are made when the process groups are, not at their first collective: colocated
servers size their KV cache from the memory free when they start, after the groups exist."""

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# A fresh process: `init_distributed` does nothing where a group exists already.
PROGRAM = """
import torch, torch.distributed as dist
from RL2.parallel import ParallelDims, init_distributed
device = torch.device("cuda", 0)
init_distributed(device)
assert dist.group.WORLD.bound_device_id == device, dist.group.WORLD.bound_device_id
dims = ParallelDims(1, device_type="cuda")
dims.build_mesh()
tp = dist.new_group([0])
torch.cuda.synchronize()
free_before = torch.cuda.mem_get_info(device)[0]
x = torch.ones(1024, device=device)
for group in (None, dims.dp_mesh.get_group(), dims.shard_mesh.get_group(), tp):
    dist.all_reduce(x, group=group)
torch.cuda.synchronize()
drop = free_before - torch.cuda.mem_get_info(device)[0]
print(f"free memory lost to the first collectives: {drop / 2**20:.1f} MiB")
assert drop < 32 * 2**20, drop
dist.destroy_process_group()
"""


def test_communicators_exist_before_the_first_collective():
    result = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True, timeout=300)
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
