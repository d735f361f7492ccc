"""Shared-memory segments in /dev/shm for ranks on one host: create, map, agree.

A segment lives in /dev/shm only until every rank of its group has mapped it; the caller unlinks the
file right after. A run killed in between leaves the file: its name records the process that named it
(`segment_name`), and the next run on the host removes the files of processes that are gone
(`remove_orphans`).
"""

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
        except ValueError:
            continue  # not a name of ours
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass  # another run removed it first
        except PermissionError:
            continue  # alive, another user's


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
        os.close(descriptor)
        os.unlink(path)
        raise
    os.close(descriptor)


def map_segment(path: str, size: int) -> mmap.mmap:
    """The file as a writable shared mapping (which outlives the file)."""
    descriptor = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(descriptor, max(size, 1), mmap.MAP_SHARED)
    finally:
        os.close(descriptor)
