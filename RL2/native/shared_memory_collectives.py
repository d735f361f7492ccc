"""FSDP's all-gathers and reduce-scatters for CPU ranks on one host through a /dev/shm segment every rank maps, small
gloo all-reduces as barriers, instead of gloo's loopback TCP; FSDP's custom-comm hooks also allocate its buffers there
(`Slots`). docs/cpu.md has the design and figures; `RL2_SHARED_MEMORY_COLLECTIVES=0` turns it off."""

import functools
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from RL2.native import switches
from RL2.native.shared_memory import SHM_DIR, map_segments, remove_orphans, segment_name
from RL2.parallel import all_gather_objects, clear_on_close
from RL2.utils.logging import log_rank0

PREFIX = "rl2-collectives"
_ALIGN = 2**21  # each rank's part starts on a 2 MB boundary: aligned for any dtype, and few regrowths


class SharedMemoryCollectives:
    """All-gathers and reduce-scatters over one group of ranks on one host. Build with `for_group`."""

    def __init__(self, group, name: str):
        self.group, self.name = group, name
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.part_bytes = 0  # room for each rank's part in `segment`
        self.segment: torch.Tensor | None = None  # uint8 [world * part_bytes]
        self.grown = 0
        self.usable = True  # False once the ranks agreed that the segment cannot grow: gloo from then on
        self.calls = 0  # collectives that went through shared memory
        self.in_place = 0  # of them, on buffers FSDP wrote in shared memory itself
        self.in_segment = 0  # of those, reduce-scatters whose input was this rank's part of `segment`
        self.slots = Slots(self)

    @classmethod
    @functools.cache
    def for_group(cls, group) -> "SharedMemoryCollectives | None":
        """The group's collectives (one per process and group, shared by every model on it); None where they
        do not apply. Collective over `group`."""
        if not switches.shared_memory_collectives() or dist.get_world_size(group) == 1:
            return None
        info = all_gather_objects((socket.gethostname(), os.path.isdir(SHM_DIR), segment_name(PREFIX)), group)
        if len({host for host, _, _ in info}) != 1 or not all(has_shm for _, has_shm, _ in info):
            return None
        if dist.get_rank(group) == 0:
            remove_orphans(PREFIX)
        return cls(group, info[0][2])

    def attach(self, model: torch.nn.Module) -> None:
        """Route every FSDP module of `model` through these; the buffers of all but the root live in shared memory."""
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_AllGather(self))
                module.set_custom_reduce_scatter(_ReduceScatter(self))
                if module is not model:
                    self.slots.fit(_gathered_bytes(module, self.world))

    def _free_parts(self, nbytes: int) -> torch.Tensor | None:
        """Every rank's part `[world, nbytes]` of the segment, grown if needed, once every rank has read what
        the previous collective left in it; None: use gloo. Collective."""
        if nbytes > self.part_bytes and self.usable:  # grow it
            self.segment = None  # the old one goes once nothing reads it
            self.part_bytes = -(-nbytes // _ALIGN) * _ALIGN
            self.segment = self.new_segment(self.part_bytes * self.world)
        if not self.usable:
            return None
        self._barrier()
        return self.segment.view(self.world, self.part_bytes)[:, :nbytes]

    def new_segment(self, size: int) -> torch.Tensor | None:
        """A segment of `size` bytes made by the group's first rank and mapped by all; or, if that fails
        anywhere, None everywhere and `usable` turns False. Collective."""
        path = os.path.join(SHM_DIR, f"{self.name}-{self.grown}")
        self.grown += 1
        mappings, error = map_segments([path], path if self.rank == 0 else None, size, self.group)
        if mappings is None:
            self.usable = False
            if self.rank == 0:  # the same work goes on over gloo, slower: say why once
                log_rank0(f"FSDP collectives go through gloo from now on: no shared-memory segment of {size} bytes "
                          f"({error or 'another rank could not map it'}; a container's {SHM_DIR} is often 64 MB: "
                          f"docker run --shm-size=...)")
            return None
        return torch.frombuffer(mappings[0], dtype=torch.uint8)

    def input_part(self, size, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """This rank's part of the segment as a `size` tensor, for the input of the reduce-scatter that
        comes next, which FSDP writes itself; None where it cannot be (use memory of its own). Collective."""
        if device.type != "cpu":
            return None
        parts = self._free_parts(torch.Size(size).numel() * dtype.itemsize)
        return None if parts is None else parts[self.rank].view(dtype).view(size)

    def _holds_my_part(self, tensor: torch.Tensor) -> bool:
        return self.segment is not None and tensor.data_ptr() == self.segment.data_ptr() + self.rank * self.part_bytes

    def _barrier(self) -> None:
        dist.all_reduce(torch.zeros(1), group=self.group)  # ~5x cheaper than gloo's barrier

    def _publish(self, input: torch.Tensor) -> torch.Tensor | None:
        """Write this rank's `input` into its part of the segment; every rank's part `[world, numel]` in
        `input`'s dtype once all have written; None: use gloo. Collective."""
        parts = self._free_parts(input.numel() * input.element_size())
        if parts is None:
            return None
        parts[self.rank].view(input.dtype).copy_(input.reshape(-1))
        self._barrier()  # every part is written
        return parts.view(input.dtype)

    @torch.no_grad()
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        """output `[world * n]` = every rank's input `[n]`, in rank order; False: not done (use gloo)."""
        if self.slots.holds(output):
            mine = output.view(self.world, -1)[self.rank]
            if mine.data_ptr() != input.data_ptr():  # FSDP copies its shard in place; anyone else, here
                mine.copy_(input)
            self._barrier()  # every rank's shard is in place
            self.in_place += 1
        else:
            parts = self._publish(input)
            if parts is None:
                return False
            output.view(self.world, -1).copy_(parts)
        self.calls += 1
        return True

    @torch.no_grad()
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        """output `[n]` = the sum in rank order of this rank's slice of every input `[world * n]`; False: use gloo."""
        if self.slots.holds(output):
            raise RuntimeError("a reduce-scatter's output was handed out in shared memory, where the next "
                               "collectives overwrite it: set RL2_SHARED_MEMORY_COLLECTIVES=0")
        if self.slots.holds(input):
            self._barrier()  # every rank's input is in place
            parts = self.slots.inputs_of_every_rank(input)
            self.in_place += 1
        elif self._holds_my_part(input):  # every rank's input is in place after the barrier of _free_parts
            parts = self._free_parts(input.numel() * input.element_size()).view(input.dtype)
            self.in_place += 1
            self.in_segment += 1
        else:
            parts = self._publish(input)
        if parts is None:
            return False
        n = output.numel()
        slices = [parts[r, self.rank * n : (self.rank + 1) * n] for r in range(self.world)]
        flat = output.view(-1)
        torch.add(slices[0], slices[1], out=flat)
        for part in slices[2:]:
            flat.add_(part)
        self.calls += 1
        return True


# The cache keeps every group it was asked about: emptied when the run's groups are destroyed.
clear_on_close(SharedMemoryCollectives.for_group.cache_clear)


class Slots:
    """FSDP's all-gather outputs and reduce-scatter inputs of up to `slot_bytes` in a shared segment. Two slots a kind,
    in turn, are enough: a rank writes slot k % 2 after the barrier of collective k - 1, which others reach when done
    with collective k - 2 (FSDP copies a gathered layer out before the next all-gather, prefetch included; a
    reduce-scatter reads its inputs within the call). Ranks allocate alike, so buffer k is the same slot everywhere."""

    PER_KIND = 2

    def __init__(self, collectives: SharedMemoryCollectives):
        self.collectives = collectives
        self.slot_bytes = 0  # the largest buffer wanted in shared memory
        self.gather: list[torch.Tensor] = []  # uint8 [slot_bytes] each
        self.scatter: list[torch.Tensor] = []  # uint8 [world, slot_bytes] each
        self.turn = {"gather": 0, "scatter": 0}
        self.span = (0, 0)  # addresses of the segment

    def fit(self, nbytes: int) -> None:
        self.slot_bytes = max(self.slot_bytes, -(-nbytes // _ALIGN) * _ALIGN)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.span[0] <= tensor.data_ptr() < self.span[1]

    def buffer(self, kind: str, size, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The next `kind` ("gather" or "scatter") slot as a `size` tensor (this rank's input for
        "scatter"); None where it does not fit or shared memory is out of use. Collective."""
        nbytes = torch.Size(size).numel() * dtype.itemsize
        if device.type != "cpu" or nbytes > self.slot_bytes or not self.collectives.usable:
            return None
        if not self.gather or self.gather[0].numel() < self.slot_bytes:
            self._map()
            if not self.gather:
                return None
        slots = self.gather if kind == "gather" else [s[self.collectives.rank] for s in self.scatter]
        index = self.turn[kind]
        self.turn[kind] = (index + 1) % self.PER_KIND
        return slots[index][:nbytes].view(dtype).view(size)

    def inputs_of_every_rank(self, input: torch.Tensor) -> torch.Tensor:
        """`[world, numel]` the reduce-scatter inputs of every rank in the slot `input` is in."""
        for slot in self.scatter:
            if slot[self.collectives.rank].data_ptr() == input.data_ptr():
                return slot[:, : input.numel() * input.element_size()].view(input.dtype)
        raise ValueError("not a reduce-scatter input of these slots")

    def _map(self) -> None:
        world, size = self.collectives.world, self.slot_bytes
        self.gather, self.scatter, self.span = [], [], (0, 0)  # the old slots go once nothing reads them
        segment = self.collectives.new_segment(self.PER_KIND * size * (1 + world))
        if segment is None:
            return
        self.gather = list(segment[: self.PER_KIND * size].view(self.PER_KIND, size))
        self.scatter = list(segment[self.PER_KIND * size :].view(self.PER_KIND, world, size))
        self.span = (segment.data_ptr(), segment.data_ptr() + segment.numel())
        self.turn = {"gather": 0, "scatter": 0}


def _gathered_bytes(module: torch.nn.Module, world: int) -> int:
    """The most bytes of an all-gather output of FSDP `module`'s own parameters (those of no nested
    FSDP module): each padded to a multiple of `world` rows, at no less than 4 bytes an element."""
    nested = {id(p) for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)
              for p in sub.parameters()}
    shapes = [(p.shape if p.dim() else torch.Size([1]), p.element_size()) for p in module.parameters()
              if id(p) not in nested]
    return sum(-(-shape[0] // world) * world * shape[1:].numel() * max(size, 4) for shape, size in shapes)


class _AllGather(AllGather):
    def __init__(self, collectives: SharedMemoryCollectives):
        self.collectives = collectives

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        in_place = self.collectives.slots.buffer("gather", size, dtype, device)
        return in_place if in_place is not None else torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if group is self.collectives.group and self.collectives.all_gather(output_tensor, input_tensor):
            return None  # done: FSDP waits only on a returned Work
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _ReduceScatter(ReduceScatter):
    def __init__(self, collectives: SharedMemoryCollectives):
        self.collectives = collectives
        self.input_numel: int | None = None  # of the input just handed out, until its output is asked for

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # FSDP asks for a reduce-scatter's input, then for its output (`world` times smaller), which it
        # keeps past the call: only the input goes into a slot.
        numel = torch.Size(size).numel()
        if self.input_numel is not None and numel * self.collectives.world == self.input_numel:
            self.input_numel = None
            return torch.empty(*size, dtype=dtype, device=device)
        self.input_numel = numel
        in_place = self.collectives.slots.buffer("scatter", size, dtype, device)
        if in_place is None:  # too large for a slot (the root module's)
            in_place = self.collectives.input_part(size, dtype, device)
        return in_place if in_place is not None else torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        summed = op == dist.ReduceOp.SUM  # what RL2 asks FSDP for (`sum_gradients_over_ranks`)
        if summed and group is self.collectives.group and self.collectives.reduce_scatter(output_tensor, input_tensor):
            return None
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
