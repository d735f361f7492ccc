"""Process-group setup and `ParallelDims`, the one object that holds the parallel layout: the 4-D grid
`(ddp, fsdp, cp, tp)` of docs/parallelism.md, whose data-parallel ranks (`dp = ddp * fsdp`) see different data."""

import contextlib
import datetime
import faulthandler
import functools
import gc
import os
import socket
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from RL2.config.errors import ConfigError
from RL2.config.schema import REQUEST_TIMEOUT_MARGIN


def pick_device(requested: str = "auto", key: str = "trainer.device") -> torch.device:
    """cuda when `requested` (auto, cpu or cuda) asks for it or, for auto, has it; else cpu. `key` is the
    config key that asked, for the error when CUDA is not there."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda but CUDA is not available; use {key}=auto or cpu")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        visible = torch.cuda.device_count()
        assigned = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if visible == 1 and assigned and "," not in assigned:
            # A scheduler that gives each task a GPU of its own (SLURM's --gpus-per-task=1) shows each rank
            # one device, index 0, whatever its LOCAL_RANK. (Ranks made to share one, a single
            # CUDA_VISIBLE_DEVICES for all, stop at their first collective: NCCL's "Duplicate GPU detected".)
            return torch.device("cuda", 0)
        if local_rank >= visible:
            raise RuntimeError(f"LOCAL_RANK={local_rank} but this process sees {visible} GPU(s) "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): each rank "
                               f"of a node needs a GPU of its own. Start at most {visible} ranks per node (torchrun "
                               f"--nproc_per_node={visible}) or make more GPUs visible")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# Seconds a rank waits in a collective for the others before the run fails (torch's default for gloo).
COLLECTIVE_TIMEOUT = 1800.0


def collective_timeout(cfg) -> float:
    """Seconds every process group waits in a collective: with a rollout, by default at least one request's
    timeout plus a margin, as a rank whose rollout is done waits in the gather while another's request runs."""
    chosen = (cfg.get("trainer") or {}).get("collective_timeout")  # the evaluator's config has no trainer
    request = (cfg.get("rollout") or {}).get("request_timeout")
    least = request + REQUEST_TIMEOUT_MARGIN if request is not None else 0.0
    return max(COLLECTIVE_TIMEOUT, least) if chosen is None else float(chosen)


def init_distributed(device: torch.device, timeout: float = COLLECTIVE_TIMEOUT) -> None:
    """Join the process group torchrun describes; at world size 1 without torchrun, make a 1-rank group,
    so that the same code (FSDP2, DCP checkpoints) runs everywhere. On the CPU that group keeps its keys in an
    in-process store: no port to find free, and no TCP store server whose thread outlives the group."""
    if dist.is_initialized():
        return
    if not faulthandler.is_enabled():  # a rank that native code kills prints its threads' stacks (docs/parallelism.md)
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stderr that is no file (a notebook's)
            faulthandler.enable(all_threads=True)
    single = "RANK" not in os.environ  # plain `python -m RL2.trainer.X`
    backend = "nccl" if device.type == "cuda" else "gloo"
    if single:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        if backend == "nccl":
            os.environ.update(MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout)
    if single and backend == "gloo":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        # `device_id` binds the group to this GPU: NCCL makes the world's communicator now, and every group
        # made later (the device mesh's, a server's tensor-parallel group) its own at creation, split from
        # it. Lazily they would come at the first collective, after colocated servers have sized their KV
        # cache from the free memory, and take memory the servers counted on (`empty_cache` cannot return it).
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    # Groups made later do not inherit the world's timeout: `new_group` without one takes c10d's default
    # for the backend, which these module attributes hold.
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.distributed_c10d.default_pg_nccl_timeout = timeout


_PER_GROUP_CACHES: list[Callable[[], None]] = []


def clear_on_close(clear: Callable[[], None]) -> None:
    """Have `close_process_groups` call `clear` after a finished run: the `cache_clear` of a cache whose
    entries hold process groups (one object per group)."""
    if clear not in _PER_GROUP_CACHES:
        _PER_GROUP_CACHES.append(clear)


def close_process_groups(finished: bool = True) -> None:
    """Destroy every process group; after a finished run, free them now, while the interpreter is whole:
    `dist.destroy_process_group` only forgets them, and an object that holds one keeps it and its gloo threads
    until the teardown, where finished runs have aborted, rarely, with "terminate called without an active
    exception". So the caches of per-group objects (`clear_on_close`) and torch's DTensor caches (a mesh keeps
    its groups) are emptied. After an error groups are only forgotten: freeing one waits for its queued
    collectives, which the peers may never join."""
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    if finished:
        for clear in _PER_GROUP_CACHES:
            clear()
        _clear_dtensor_caches()
        # A command froze what it imported (RL2/utils/startup_gc.py), which holds no group: the collection walks
        # only what the run made.
        gc.collect()


def _clear_dtensor_caches() -> None:
    """Empty torch's DTensor caches, whose entries hold device meshes. They are torch internals that move
    between versions, so every functools cache of a `torch.distributed` module (its functions' and its classes'
    methods') is emptied, then the caches torch names for clearing; a cache that moved is skipped (and the
    teardown test finds its groups)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and module is not None:
            for value in list(vars(module).values()):
                # Only types are looked at (`type()`, not `isinstance`, which reads `__class__`): reading an
                # attribute of another object may run its code (torch's deprecated `reduce_op` warns then).
                for obj in [value, *(vars(value).values() if issubclass(type(value), type) else ())]:
                    if type(obj) in (staticmethod, classmethod):
                        obj = obj.__func__
                    if type(obj) is functools._lru_cache_wrapper and obj.__module__.startswith("torch.distributed"):
                        obj.cache_clear()
    moved = contextlib.suppress(ImportError, AttributeError)
    with moved:
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    with moved:
        torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    with moved:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

        clear_redistribute_planner_cache()


def shard_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor, sharing its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (another process could still take it before the caller does)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def all_gather_objects(value, group=None) -> list:
    """Every rank's `value` (of `group`, the world by default), in rank order. Collective."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


@dataclass
class ParallelDims:
    """Degrees of each kind of parallelism (see the module docstring), checked once, with the device
    meshes built from them; `device_type` is "cpu" or "cuda"."""

    world_size: int
    tp: int = 1
    cp: int = 1
    ddp: int = 1
    device_type: str = "cpu"
    mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self):
        # Each degree is at least 1: the config refuses others when it is parsed (`check_model_sections`).
        model_parallel = self.tp * self.cp * self.ddp
        if self.world_size % model_parallel:
            raise ConfigError(f"cannot lay out {self.world_size} ranks as ddp x fsdp x cp x tp: ddp_size={self.ddp} x "
                              f"cp_size={self.cp} x tp_size={self.tp} = {model_parallel} does not divide the world "
                              "size (fsdp, the sharded data-parallel degree, takes the rest: world size = ddp * fsdp "
                              "* cp * tp). Set actor.ddp_size, actor.cp_size and actor.tp_size (critic.* likewise) "
                              "so that their product divides the number of ranks")
        self.fsdp = self.world_size // model_parallel

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.ddp * self.fsdp

    def build_mesh(self) -> DeviceMesh:
        """The 4-D mesh ("ddp", "fsdp", "cp", "tp") plus flattened views used by FSDP and the data."""
        if self.mesh is None:
            mesh = init_device_mesh(self.device_type, (self.ddp, self.fsdp, self.cp, self.tp),
                                    mesh_dim_names=("ddp", "fsdp", "cp", "tp"))
            self.dp_mesh = mesh[("ddp", "fsdp")]._flatten("dp")
            # Parameters are sharded over fsdp and cp together (torchtitan does the same):
            # cp ranks hold the same parameters, so they can share the shards.
            self.shard_mesh = mesh[("fsdp", "cp")]._flatten("fsdp_cp")
            self.mesh = mesh
        return self.mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Mesh for `fully_shard`: 2-D (replicate, shard) when ddp > 1, else 1-D."""
        mesh = self.build_mesh()
        if self.ddp > 1:
            with warnings.catch_warnings():  # torch has no other way yet to pair a flattened dim with another
                warnings.simplefilter("ignore")
                return mesh["ddp", "fsdp_cp"]
        return self.shard_mesh

    def describe(self) -> str:
        return (f"world size {self.world_size} = ddp {self.ddp} x fsdp {self.fsdp} x cp {self.cp} x tp {self.tp} "
                f"(dp={self.dp})")

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.build_mesh()["tp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.build_mesh()["cp"]

    @property
    def seq_parallel(self) -> int:
        """How many ranks share one micro-batch (cp ranks split its tokens, tp ranks its matrices), so it
        may hold `cp * tp * max_length_per_device` tokens (as upstream RL2)."""
        return self.cp * self.tp

    @property
    def dp_rank(self) -> int:
        self.build_mesh()
        return self.dp_mesh.get_local_rank()

    def sum_over_data(self, totals: dict[str, float], device: torch.device) -> dict[str, float]:
        """Per-rank sums -> sums over the whole global batch. Ranks that differ only in cp or tp hold the
        same sums, so they are added over the data-parallel group alone. Collective."""
        group = self.dp_mesh.get_group()
        # A rank whose share was only padding has no metrics of its own: agree on the keys first.
        keys = sorted(set().union(*all_gather_objects(sorted(totals), group)))
        summed = torch.tensor([totals.get(key, 0.0) for key in keys], dtype=torch.float64, device=device)
        dist.all_reduce(summed, group=group)
        return dict(zip(keys, summed.tolist()))

    @classmethod
    def from_config(cls, model_cfg, device: torch.device) -> "ParallelDims":
        return cls(world_size=dist.get_world_size(), tp=model_cfg.tp_size, cp=model_cfg.cp_size,
                   ddp=model_cfg.ddp_size, device_type=device.type)
