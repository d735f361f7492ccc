"""`<save_dir>/run.lock` names the run that writes to a save_dir (`claim_save_dir`): two runs with one
save_dir would overwrite each other's checkpoints and `latest.txt`, and a resume could load the other
run's weights."""

import atexit
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from RL2.config.errors import ConfigError
from RL2.parallel import all_gather_objects
from RL2.utils.logging import fsync_dir, json_record, log_rank0, make_save_dir
from RL2.utils.redaction import redact_command

LOCK = "run.lock"


def claim_save_dir(save_dir: str) -> Callable[[], None]:
    """Collective: hold `<save_dir>/run.lock` for this run (rank 0 writes it), or raise a ConfigError on
    every rank that names the run holding it and what to do. Returns a function that releases the lock (also
    called at the process's exit). A lock file naming a live process on another host holds until removed."""
    problem, release = None, lambda: None
    if dist.get_rank() == 0:
        try:
            release = _take_lock(Path(save_dir))
        except ConfigError as e:
            problem = str(e)
        except OSError as e:  # a full disk, a read-only folder: every rank stops, not rank 0 alone
            problem = (f"trainer.save_dir={save_dir}: cannot write {LOCK} ({e.strerror}); give a folder this user "
                       f"can write")
    problem = all_gather_objects(problem)[0]  # rank 0's, on every rank
    if problem is not None:
        raise ConfigError(problem)
    return release


def _take_lock(root: Path) -> Callable[[], None]:
    """Hold `root/run.lock` with `flock` for this process's life: the kernel lets one process hold it and
    drops it when the process dies, so a crashed run's lock is free again and two runs that find it free at
    once cannot both take it. The file names the holder, for the message of a run that is refused."""
    path = root / LOCK
    make_save_dir(root)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "process_start": _process_start(os.getpid()),
          "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(redact_command(sys.argv))[:300]}
    _release_held(path)  # this process's previous trainer (the Python API runs one after another)
    for _ in range(3):  # the holder may release, removing the file, while this process waits for it
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(_held_message(root, path, _read_lock(path))) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # locked a file its holder removed on release: lock the one at the path now
    else:
        raise ConfigError(_held_message(root, path, _read_lock(path)))
    holder, identity = _read_lock(path), ("host", "pid", "process_start")
    other = holder is not None and [holder.get(key) for key in identity] != [me[key] for key in identity]
    # A live holder that does not hold the flock: a run on another host (a network folder's locks may not
    # reach this one) or an RL2 from before the flock.
    if other and _alive(holder):
        os.close(fd)
        raise ConfigError(_held_message(root, path, holder))
    if other:
        log_rank0(f"trainer.save_dir: taking over {path} from process {holder.get('pid')}, which is gone")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        fsync_dir(root)
    except OSError:
        os.close(fd)
        raise
    _HELD[str(path)] = fd

    def release() -> None:
        atexit.unregister(release)
        _release_held(path)

    atexit.register(release)  # a run that fails before its end leaves no lock behind either
    return release


# The lock files this process holds (path -> the open file its flock is on): a flock belongs to an open
# file, so the process must keep it open, and a later trainer of the same process takes it over.
_HELD: dict[str, int] = {}


def _release_held(path: Path) -> None:
    """Remove and unlock `path` if this process holds it (removed first: a waiting run then locks a fresh file)."""
    fd = _HELD.pop(str(path), None)
    if fd is None:
        return
    if _same_file(fd, path):
        path.unlink(missing_ok=True)
    os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether open file `fd` is the file at `path` now (not one removed from it)."""
    try:
        current = path.stat()
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (opened.st_dev, opened.st_ino) == (current.st_dev, current.st_ino)


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot, field 22 of /proc/<pid>/stat): tells the
    process that wrote a lock from a later one given the same pid. None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # the fields after the command name begin at field 3


def _read_lock(path: Path) -> dict | None:
    """The holder a lock file names; None when it cannot be read or is empty (being written, or damaged)."""
    try:
        return json_record(path.read_text())
    except (OSError, ValueError):  # ValueError: text that is not UTF-8
        return None


def _alive(holder: dict) -> bool:
    """Whether the process that wrote lock `holder` still runs, as far as this host can tell: one on
    another host is taken to be alive."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    started = holder.get("process_start")
    return started is None or _process_start(pid) in (None, started)


def _held_message(root: Path, path: Path, holder: dict | None) -> str:
    if holder is None:
        who = f"another run ({path} names no process: it is being written, or damaged)"
    else:
        who = (f"process {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')} "
               f"({holder.get('command')})")
    if holder is not None and holder.get("host") == socket.gethostname():
        stale = "or wait for that run to end (or stop it)"
    else:
        stale = (f"or, if no run uses this save_dir any more (one on another host cannot be checked from here), "
                 f"remove {path}")
    return (f"trainer.save_dir={root} is in use by {who}: two runs in one save_dir overwrite each other's "
            f"checkpoints and latest.txt. Give this run another trainer.save_dir (or trainer.experiment_name), "
            f"{stale}")
