"""Under torchrun (2 or 3 CPU ranks): FSDP's collectives through shared memory equal gloo's.

    torchrun --nproc_per_node=2 tests/e2e/scripts/shared_collectives.py

(then, in the same launch, `shared_gather.py`'s checks of weight syncs through shared memory).

Checks: all-gathers (float32 and bf16) and summed reduce-scatters of random buffers equal gloo's, also
after the segment grows for a larger buffer (exactly on 2 ranks, where a sum of two is the same in any
order; to rounding on 3); a tiny FSDP2-sharded Llama trained through them has the gradients and, after
each of three AdamW steps, the parameters of its twin trained over gloo, with ranks slowed at random
so that one runs ahead, and went through shared memory for every layer (the layers' buffers written
there by FSDP itself, and the root's reduce-scatter input); no segment file stays in /dev/shm, and the files
a killed run left (named for a process that no
longer exists) are removed while those of a live process stay; ranks that report different hosts get
None.
"""

import glob
import os
import random
import subprocess
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

from RL2.native import shared_memory_collectives
from RL2.native.shared_memory_collectives import SharedMemoryCollectives
from RL2.parallel import close_process_groups
from tests.e2e.scripts.shared_gather import check_shared_gather
from tests.helpers.launch import separate_hosts


def expect_equal(got: torch.Tensor, expected: torch.Tensor, exact: bool, what: str, tolerance: float = 1e-6) -> None:
    if exact:
        assert torch.equal(got, expected), what
    else:
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance, msg=what)


def check_buffers(collectives: SharedMemoryCollectives, exact: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    for n in (1000, 3 * 2**20 + 5):  # the second one grows the segment past its first 2 MB parts
        for dtype in (torch.float32, torch.bfloat16):
            shard = torch.randn(n, generator=generator).to(dtype)
            got, expected = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
            assert collectives.all_gather(got, shard)
            dist.all_gather_into_tensor(expected, shard)
            assert torch.equal(got, expected), ("all-gather", n, dtype)
        grads = torch.randn(world * n, generator=generator)
        got, expected = torch.empty(n), torch.empty(n)
        assert collectives.reduce_scatter(got, grads)
        dist.reduce_scatter_tensor(expected, grads.clone())
        expect_equal(got, expected, exact, f"reduce-scatter of {n}")


VOCAB = 9001  # the root's embedding and head (4.6 MB) outgrow the layers' 2 MB slots, as a real model's do


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=VOCAB)
    return AutoModelForCausalLM.from_config(config)


def sharded(model: torch.nn.Module, mesh) -> torch.nn.Module:
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():  # as RL2's workers do (`sum_gradients_over_ranks`)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def skew_ranks(model: torch.nn.Module, seed: int) -> None:
    """Random sleeps of up to 20 ms before each layer's forward and backward, different on every rank:
    one rank runs ahead of the other into the next collectives, as on a busy machine."""
    generator = random.Random(seed)

    def sleep(*_):
        time.sleep(generator.random() / 50)

    for layer in model.model.layers:
        layer.register_forward_pre_hook(sleep)
        layer.register_full_backward_pre_hook(sleep)


def check_training(mesh, exact: bool) -> None:
    through_memory, over_gloo = sharded(tiny_llama(), mesh), sharded(tiny_llama(), mesh)
    collectives = SharedMemoryCollectives.for_group(mesh.get_group())
    collectives.attach(through_memory)
    skew_ranks(through_memory, seed=dist.get_rank())
    calls, in_place, in_segment = collectives.calls, collectives.in_place, collectives.in_segment
    # On 3 ranks the gradients equal gloo's to rounding; AdamW multiplies a gradient's rounding by up to
    # lr / eps where it nearly cancels over the ranks (1e6 at the default eps): eps is larger here, and the
    # parameters are compared to 1e-5, a thousandth of a step.
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6) for model in (through_memory, over_gloo)]
    torch.manual_seed(100 + dist.get_rank())
    for step in range(3):
        input_ids = torch.randint(0, VOCAB, (2, 17))
        for model in (through_memory, over_gloo):
            model(input_ids=input_ids, labels=input_ids).loss.backward()
        for (name, a), (_, b) in zip(through_memory.named_parameters(), over_gloo.named_parameters()):
            expect_equal(a.grad.to_local(), b.grad.to_local(), exact, f"gradient of {name} at step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for (name, a), (_, b) in zip(through_memory.named_parameters(), over_gloo.named_parameters()):
            expect_equal(a.to_local(), b.to_local(), exact, f"{name} after step {step}", tolerance=1e-5)
    # 3 FSDP modules (2 layers and the root): an all-gather each in forward and in backward (the root's
    # stays gathered), a reduce-scatter each; the layers' on buffers FSDP wrote in shared memory itself,
    # and the root's reduce-scatter (too large for the layers' slots) on its input FSDP wrote in this
    # rank's part of the segment.
    assert collectives.calls - calls >= 3 * (3 + 2 + 3), collectives.calls - calls
    assert collectives.in_place - in_place >= 3 * (2 + 2 + 3), collectives.in_place - in_place
    assert collectives.in_segment - in_segment == 3, collectives.in_segment - in_segment


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    exact = world == 2
    mesh = init_device_mesh("cpu", (world,))
    if rank == 0:  # what a killed run leaves, and a live run's file
        gone = subprocess.Popen(["true"])
        gone.wait()  # reaped: no process has its id now
        orphan, alive = f"/dev/shm/rl2-collectives-{gone.pid}-orphan", f"/dev/shm/rl2-collectives-{os.getppid()}-alive"
        for path in (orphan, alive):
            open(path, "w").close()
    collectives = SharedMemoryCollectives.for_group(mesh.get_group())
    assert collectives is not None
    if rank == 0:
        assert not os.path.exists(orphan) and os.path.exists(alive)
        os.unlink(alive)
    check_buffers(collectives, exact)
    assert collectives.grown > 1 and collectives.usable  # it grew for the larger buffers
    check_training(mesh, exact)
    assert not glob.glob(f"/dev/shm/{collectives.name}*"), "segment files are unlinked once mapped"

    # Ranks that are not on one host (as far as their names tell) stay on gloo.
    with separate_hosts(shared_memory_collectives, rank):
        assert SharedMemoryCollectives.for_group(dist.new_group(list(range(world)))) is None

    dist.barrier()
    if rank == 0:
        print("shared collectives OK")
    check_shared_gather()
    close_process_groups()


if __name__ == "__main__":
    main()
