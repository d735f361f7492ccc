"""Full parameters through `SharedMemoryGather` equal gloo's all-gather: `check_shared_gather`, which
`shared_collectives.py` runs after its own checks (one launch for both), or alone:

    torchrun --nproc_per_node=2 tests/e2e/scripts/shared_gather.py

Checks, on a tiny FSDP2-sharded Llama with unevenly sharded parameters (an odd vocabulary, and one
row that leaves every rank but the first an empty shard): every full tensor equals `DTensor.full_tensor()`
exactly, in float32 and cast to bf16, in one chunk and in many; a second sync sees weights changed in between;
the shared-memory files are gone once set up, the segments hold a chunk rather than the model, and a
sync takes no more /dev/shm pages than the build reserved; and ranks that report different hosts
fall back (build returns None on all).
"""

import glob

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

from RL2.native import shared_memory_gather
from RL2.native.shared_memory import shm_free_bytes
from RL2.native.shared_memory_gather import SharedMemoryGather
from RL2.parallel import close_process_groups
from tests.helpers.launch import separate_hosts


def expect_full_tensors(gather: SharedMemoryGather, model: torch.nn.Module, dtype: torch.dtype) -> None:
    expected = [(name, param.full_tensor().to(dtype)) for name, param in model.named_parameters()]
    got = list(gather.full_tensors())
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, tensor), (_, full) in zip(got, expected):
        assert tensor.dtype == dtype and tensor.shape == full.shape, (name, tensor.shape, full.shape)
        assert torch.equal(tensor, full), name


def check_shared_gather() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=301, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    model.register_parameter("one_row", torch.nn.Parameter(torch.randn(1, 5)))  # rank 1's shard is empty
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model.one_row.to_local().shape[0] == (1 if rank == 0 else 0)

    before = set(glob.glob("/dev/shm/rl2-shards-*"))
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    world = dist.get_world_size()
    largest_shard = max(-(-p.shape[0] // world) * p[0].numel() for p in model.parameters()) * 4  # any rank's
    # The default chunk holds the whole tiny model; 4 KB chunks cut it into many, each shard alone.
    for chunk_bytes in (shared_memory_gather.CHUNK_BYTES, 4096):
        shared_memory_gather.CHUNK_BYTES = chunk_bytes
        for dtype in (torch.float32, torch.bfloat16):
            gather = SharedMemoryGather.build(model, dtype)
            assert gather is not None
            assert set(glob.glob("/dev/shm/rl2-shards-*")) <= before, "the segment files are unlinked once mapped"
            assert (len(gather.chunks) > 5) == (chunk_bytes == 4096), len(gather.chunks)
            segment_bytes = gather.segments[rank].numel()
            assert segment_bytes <= max(chunk_bytes, largest_shard + 64), (segment_bytes, chunk_bytes)
            assert segment_bytes < model_bytes / 2 or chunk_bytes > model_bytes
            dist.barrier()
            free_before = shm_free_bytes()
            expect_full_tensors(gather, model, dtype)
            with torch.no_grad():  # an optimizer step in between: the next sync must see it
                for param in model.parameters():
                    param.to_local().mul_(-2).add_(rank + 1)
            expect_full_tensors(gather, model, dtype)
            dist.barrier()
            assert shm_free_bytes() >= free_before - 8 * 4096, "a sync writes into the pages reserved at build"
            del gather
    # Ranks that are not on one host (as far as their names tell) all-gather with gloo instead.
    with separate_hosts(shared_memory_gather, rank):
        assert SharedMemoryGather.build(model, torch.float32) is None
    dist.barrier()
    if rank == 0:
        print("shared gather OK")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    check_shared_gather()
    close_process_groups()
