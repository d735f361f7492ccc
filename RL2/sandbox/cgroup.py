"""A memory cgroup per code sandbox: one limit on the memory of all its processes together (see
docs/rewards.md), where RLIMIT_AS bounds each process alone.

The cgroup is made under the trainer's own cgroup (as /proc/self/cgroup names it), never at the
root of the hierarchy: cgroup v1's memory controller, or cgroup v2's (with pids.max where the pids
controller is enabled). Making one needs write access to that cgroup (root, or a delegated subtree)
and, in v2, the memory controller enabled for its children, which v2 allows a cgroup that holds
processes (the trainer) only at the root of the hierarchy: a trainer in any other v2 cgroup keeps
the per-process limit only.
"""

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = "/sys/fs/cgroup"
# Killed processes leave their cgroup once the kernel has torn them down, which takes a moment.
REMOVE_TIMEOUT_S = 5.0

log = logging.getLogger(__name__)


@dataclass
class CgroupParent:
    """The trainer's own cgroup with the memory controller, under which each sandbox gets one."""

    path: Path
    version: int  # 1 or 2


def find_parent(root: str = DEFAULT_ROOT, own_cgroups: str = "/proc/self/cgroup") -> tuple[CgroupParent | None, str]:
    """Where sandboxes' cgroups can be made.

    Args:
        root: where the cgroup file systems are mounted (v1: one folder per controller, `memory`
            among them; v2: the unified hierarchy itself, or its `unified` folder beside v1's).
        own_cgroups: this process's cgroups, as `/proc/self/cgroup` lists them.

    Returns:
        (parent, "") or (None, why none can be made).
    """
    try:
        with open(own_cgroups) as f:
            lines = [fields for line in f if len(fields := line.rstrip("\n").split(":", 2)) == 3]
    except OSError as e:
        return None, f"cannot read {own_cgroups}: {e}"
    for _, controllers, own_path in lines:
        if "memory" in controllers.split(","):
            return _usable(CgroupParent(Path(root, "memory", own_path.lstrip("/")), 1))
    unified = [own_path for hierarchy, controllers, own_path in lines if hierarchy == "0" and not controllers]
    for base in (Path(root), Path(root, "unified")):
        for own_path in unified:
            path = base / own_path.lstrip("/")
            if "memory" in _read(path / "cgroup.controllers").split():
                return _usable(CgroupParent(path, 2))
    return None, f"no cgroup hierarchy with the memory controller under {root}"


def _usable(parent: CgroupParent) -> tuple[CgroupParent | None, str]:
    """`parent` if this process may make cgroups in it (enabling v2's memory controller for them)."""
    marker = "memory.limit_in_bytes" if parent.version == 1 else "cgroup.controllers"
    if not (parent.path / marker).exists():
        return None, f"{parent.path} is not a memory cgroup"
    if not os.access(parent.path, os.W_OK):
        return None, f"{parent.path} is not writable here"
    if parent.version == 2:
        enabled = _read(parent.path / "cgroup.subtree_control").split()
        for controller in ("memory", "pids"):
            if controller in enabled or controller not in _read(parent.path / "cgroup.controllers").split():
                continue
            try:
                (parent.path / "cgroup.subtree_control").write_text(f"+{controller}")
            except OSError as e:  # v2 refuses it to a cgroup that holds processes itself
                if controller == "memory":
                    return None, (f"cgroup v2 cannot enable the memory controller under {parent.path}, which "
                                  f"holds the trainer's processes ({e})")
    return parent, ""


@dataclass
class SandboxCgroup:
    """One sandbox's cgroup: made with its limits, joined by the sandbox's first process (which writes
    its pid to `procs_file`), removed with whatever is left in it."""

    path: Path
    version: int  # 1 or 2

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    @classmethod
    def create(cls, parent: CgroupParent, name: str, memory_bytes: int, max_tasks: int) -> "SandboxCgroup":
        """Make the cgroup `name` under `parent` with these limits; raises OSError where it cannot.

        Args:
            memory_bytes: the memory of all its processes together (swap none).
            max_tasks: its processes and threads (v2's pids.max, where enabled).
        """
        cgroup = cls(parent.path / name, parent.version)
        cgroup.path.mkdir()
        try:
            if not cgroup.procs_file.exists():  # a plain folder: the kernel fills a cgroup's at mkdir
                raise OSError(f"{cgroup.path} is not a cgroup")
            if parent.version == 1:
                # memsw (memory + swap) may not go below the memory limit, so memory comes first.
                cgroup._write("memory.limit_in_bytes", memory_bytes)
                cgroup._write("memory.memsw.limit_in_bytes", memory_bytes, optional=True)
            else:
                cgroup._write("memory.max", memory_bytes)
                cgroup._write("memory.swap.max", 0, optional=True)
                cgroup._write("pids.max", max_tasks, optional=True)
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        if optional and not (self.path / name).exists():  # swap not accounted, pids not enabled
            return
        (self.path / name).write_text(str(value))

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer took in this cgroup (v1: memory.oom_control, v2: memory.events)."""
        events = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in _read(self.path / events).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> int:
        """Kill what is left in the cgroup and remove it.

        Returns:
            the processes the OOM killer took in it (read first: the counter goes with the cgroup).
        """
        oom_kills = self.oom_kills()
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        while True:
            for pid in map(int, _read(self.procs_file).splitlines()):
                # cgroup v2 lists a process of another pid namespace as 0, which os.kill would read as our
                # own process group; the trainer itself is never in the cgroup, but a kill must not be able
                # to reach it.
                if pid <= 0 or pid == os.getpid():
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:  # ended meanwhile, or not ours to kill: the removal below says so
                    pass
            try:
                self.path.rmdir()
                return oom_kills
            except FileNotFoundError:
                return oom_kills
            except OSError as e:  # EBUSY while killed processes are still being torn down
                if time.monotonic() > deadline:
                    log.warning("code sandbox: could not remove the cgroup %s: %s", self.path, e)
                    return oom_kills
                time.sleep(0.01)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # removed, never made, or not a cgroup's file
        return ""
