"""Full parameters from FSDP shards through shared memory, for the weight sync of ranks on one CPU host: each
rank writes its shards into a /dev/shm segment of its own, and every rank reads the others' directly, a chunk of
about CHUNK_BYTES per rank at a time (docs/cpu.md, "Weight sync"). Where this does not apply
`SharedMemoryGather.build` returns None and the caller all-gathers with `DTensor.full_tensor`."""

import math
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from RL2.native import shared_memory as shm
from RL2.parallel import all_gather_objects
from RL2.utils.logging import log_rank0

PREFIX = "rl2-shards"
_ALIGN = 64  # bytes: every shard starts on a cache line, and any dtype's view of it is aligned
CHUNK_BYTES = 64 * 2**20  # of each rank's shards per round of writing, waiting and reading


def _shard_rows(rows: int, ranks: int) -> list[int]:
    """Rows of dim 0 that each rank holds under FSDP2's `torch.chunk` sharding (trailing ranks may get 0)."""
    chunk = -(-rows // ranks)
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(ranks)]


def _sharded_mesh_dim(param: DTensor) -> int | None:
    """The mesh dim along which `param` is sharded on its dim 0, if that is its only sharding."""
    shards = [i for i, p in enumerate(param.placements) if p == Shard(0)]
    others = [p for p in param.placements if p != Shard(0) and not isinstance(p, Replicate)]
    return shards[0] if len(shards) == 1 and not others else None


@dataclass
class _Entry:
    name: str
    param: DTensor
    offsets: list[int]  # byte offset of each group rank's shard in that rank's segment
    rows: list[int]  # rows of dim 0 in each group rank's shard


def _chunks(params: list[tuple[str, DTensor]], ranks: int, element: int) -> tuple[list[list[_Entry]], int]:
    """The parameters in order, cut into chunks of at most CHUNK_BYTES of shards per rank (or one larger shard), with
    each shard's offset in its rank's segment; and the segment size that holds any chunk."""
    chunks: list[list[_Entry]] = [[]]
    used, size = [0] * ranks, 0
    for name, param in params:
        rows = _shard_rows(param.shape[0], ranks)
        per_row = math.prod(param.shape[1:])
        nbytes = [-(-r * per_row * element // _ALIGN) * _ALIGN for r in rows]
        if chunks[-1] and any(u + b > CHUNK_BYTES for u, b in zip(used, nbytes)):
            chunks.append([])
            used = [0] * ranks
        chunks[-1].append(_Entry(name, param, list(used), rows))
        used = [u + b for u, b in zip(used, nbytes)]
        size = max(size, *used)
    return chunks, size


class SharedMemoryGather:
    """Build with `build` (collective); then `full_tensors()` at every sync (collective)."""

    def __init__(self, chunks: list[list[_Entry]], group, dtype: torch.dtype, segments: list[torch.Tensor]):
        self.chunks, self.group, self.dtype, self.segments = chunks, group, dtype, segments
        self.rank = dist.get_rank(group)

    @classmethod
    def build(cls, model: torch.nn.Module, dtype: torch.dtype) -> "SharedMemoryGather | None":
        """Set up the segments for `model`'s parameters gathered in `dtype`; None where this does not
        apply. Collective over the whole world (every rank gets the same answer)."""
        named = list(model.named_parameters())
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if not named or any(p.device.type != "cpu" for _, p in named):
            return None  # the same answer on every rank without asking: they hold the same model
        meshes = {(p.device_mesh, _sharded_mesh_dim(p)) for _, p in named if isinstance(p, DTensor)}
        usable = (len(meshes) == 1 and None not in {dim for _, dim in meshes}
                  and all(isinstance(p, DTensor) for _, p in named) and os.path.isdir(shm.SHM_DIR))
        if not shm.everyone(usable):
            return None
        mesh, mesh_dim = meshes.pop()
        group = mesh.get_group(mesh_dim)
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)

        chunks, size = _chunks(named, ranks, dtype.itemsize)
        # Not FSDP2's chunking after all?
        usable = usable and all(e.param.to_local().shape[0] == e.rows[rank] for chunk in chunks for e in chunk)

        # Which host, and the names of the group's segments (from the group's first rank).
        free = shm.shm_free_bytes() if usable else 0
        info = all_gather_objects((socket.gethostname(), shm.segment_name(PREFIX), free), group)
        fits = min(free for _, _, free in info) >= size * ranks + shm.SPARE_SHM_BYTES  # containers often have 64 MB
        usable = usable and fits and len({host for host, _, _ in info}) == 1
        if not shm.everyone(usable):
            if not fits:  # the weight sync goes on over gloo, slower: say why
                log_rank0(f"weight sync over gloo: {shm.SHM_DIR} has {min(free for _, _, free in info)} bytes free, "
                          f"{size * ranks + shm.SPARE_SHM_BYTES} needed (docker run --shm-size=...)")
            return None
        paths = [os.path.join(shm.SHM_DIR, f"{info[0][1]}-{r}") for r in range(ranks)]
        if rank == 0:
            shm.remove_orphans(PREFIX)

        mappings, _ = shm.map_segments(paths, paths[rank], size, group)
        if not shm.everyone(mappings is not None):  # every group of the world agrees
            return None
        return cls(chunks, group, dtype, [torch.frombuffer(m, dtype=torch.uint8) for m in mappings])

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor in `dtype`) for every parameter, in `named_parameters` order. Collective."""
        own = self.segments[self.rank]
        for chunk in self.chunks:
            for entry in chunk:
                self._view(own, entry, self.rank).copy_(entry.param.to_local())  # cast into the segment
            dist.barrier(group=self.group)  # every shard of the chunk is written
            try:
                for entry in chunk:
                    shards = [self._view(self.segments[r], entry, r) for r in range(len(self.segments))]
                    yield entry.name, torch.cat(shards)
            finally:
                dist.barrier(group=self.group)  # every shard is read: the segments may be written again

    def _view(self, segment: torch.Tensor, entry: _Entry, rank: int) -> torch.Tensor:
        """Group rank `rank`'s shard of `entry` in `segment`, as a tensor of its shape."""
        shape = (entry.rows[rank], *entry.param.shape[1:])
        nbytes = math.prod(shape) * self.dtype.itemsize
        start = entry.offsets[rank]
        return segment[start : start + nbytes].view(self.dtype).view(shape)
