"""Shared-memory segments in /dev/shm for ranks on one host: create, map, agree. A segment's file lives only
until every rank of its group has mapped it; a run killed in between leaves it, and as its name records the
process that named it (`segment_name`), the next run on the host removes it (`remove_orphans`)."""

import contextlib
import glob
import mmap
import os
import uuid

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
SPARE_SHM_BYTES = 64 * 2**20  # left free in /dev/shm for everything else that uses it


def everyone(flag: bool, group=None) -> bool:
    """Whether `flag` holds on every rank of `group` (the world by default). Collective."""
    agreed = torch.tensor([int(flag)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return bool(agreed.item())


def segment_name(prefix: str) -> str:
    """A fresh segment name under `prefix` that records this process."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex}"


def remove_orphans(prefix: str) -> None:
    """Unlink the /dev/shm files named by `segment_name(prefix)` whose process no longer exists."""
    for path in glob.glob(os.path.join(SHM_DIR, f"{prefix}-*")):
        try:
            pid = int(os.path.basename(path)[len(prefix) + 1 :].split("-")[0])
            os.kill(pid, 0)
        except (ValueError, PermissionError):
            pass  # not a name of ours, or a live process of another user
        except ProcessLookupError:
            with contextlib.suppress(OSError):  # another run removed it first
                os.unlink(path)


def shm_free_bytes() -> int:
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def create_segment(path: str, size: int) -> None:
    """A new file of `size` bytes, its pages allocated now: a full /dev/shm then fails here with an
    OSError, instead of killing whichever process first writes past the end."""
    descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, max(size, 1))
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(descriptor)


def map_segment(path: str, size: int) -> mmap.mmap:
    """The file as a writable shared mapping (which outlives the file)."""
    descriptor = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(descriptor, max(size, 1), mmap.MAP_SHARED)
    finally:
        os.close(descriptor)


def map_segments(paths: list[str], own: str | None, size: int, group) -> tuple[list[mmap.mmap] | None, OSError | None]:
    """Every file of `paths` (`size` bytes each) mapped on every rank of `group`, this rank first creating `own` (one
    of them; None: none) where /dev/shm has room for it; each file is unlinked once every rank has mapped it. Returns
    the mappings, or None on every rank where a file could not be made or mapped anywhere, and this rank's error."""
    error, mappings = None, None
    if own is not None:
        try:
            if shm_free_bytes() < size + SPARE_SHM_BYTES:
                raise OSError(f"{SHM_DIR} has less than {size + SPARE_SHM_BYTES} bytes free")
            create_segment(own, size)  # fails now rather than when written
        except OSError as e:
            error = e
    if everyone(error is None, group):  # every file exists
        try:
            mappings = [map_segment(path, size) for path in paths]
        except OSError as e:  # e.g. ranks on one hostname but separate /dev/shm (containers)
            error = e
    ok = everyone(mappings is not None, group)  # everyone has mapped them (or failed): the names can go
    if own is not None and os.path.exists(own):
        os.unlink(own)
    return (mappings if ok else None), error
