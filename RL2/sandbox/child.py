"""The processes a code reward's solution runs in. Started by `RL2.sandbox.runner`, never imported:

    python -I -c BOOT SPEC_JSON [TEST_JSON]

(`runner.BOOT` runs this file as __main__ from its bytecode cache).

It uses the standard library only, so that it runs before anything else is imported. In order:

1. Read the spec (the solution, the limits) and delete its file, so the solution cannot; open an
   assert test's file and delete it too (its text is read only once the solution's process is
   forked, so it is never in that process's memory); join the sandbox's memory cgroup where the
   caller made one (`cgroup.py`: one limit on the memory of all the processes below).
2. Enter new network, mount, PID, IPC and UTS namespaces (inside a user namespace of its own unless
   root of the machine): the solution sees no network but a loopback that is down, no System V or
   POSIX IPC object of the host's or of an earlier run, and its processes end with this sandbox.
   Where the system refuses them and the caller did not allow unisolated runs, stop here with a
   refusal: nothing of the solution runs.
3. Fork the namespace's first process, which builds the solution's view of the file system
   (`own_view`: a root of its own holding only the system's folders and the Python installation,
   read-only, a /dev of its own, a /proc showing only the sandbox's processes where allowed, and a
   tmpfs working directory), sets the resource limits, gives up every capability and (as root) uid
   0 itself for a uid and gid of its own, and installs a seccomp filter against Unix sockets.
4. Fork the solution's process, which closes the result pipe and the test's file before anything of
   the solution runs. For a stdio test the first process waits for it. For an assert test the first
   process is the judge: it runs the test's code, where each name the solution defines stands for a
   `Remote` whose calls cross a pipe as plain data (`plain`: None, bool, int, float, str, bytes and
   containers of them), so every comparison is Python's own on values the judge built itself; then
   it writes the verdict to the result pipe, which no process that runs solution code holds.

When namespaces are unavailable and unisolated runs are allowed, step 2 is skipped: as root the
processes still give up uid 0 (`reachable_imports` keeps a Python installed in a root-only folder
importable), and an audit hook in the solution's process refuses sockets, new processes, signals, C
libraries and writes outside the working directory: a guard against accidents, not a security
boundary (code that reaches C can go around it). The first line written to the result pipe says
which isolation was in effect.
"""

import builtins
import ctypes
import importlib
import json
import linecache
import operator
import os
import resource
import signal
import sys
import traceback
import types

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x20000000, 0x10000000
CLONE_NEWIPC, CLONE_NEWUTS = 0x08000000, 0x04000000
NAMESPACES = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, AT_FDCWD, AT_RECURSIVE = 0x1, -100, 0x8000
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 0x1, 0x4
# Linux >= 5.12; the same numbers on every architecture but alpha
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 28, 38
MNT_DETACH = 2
# The host's folders the solution sees, read-only: the system's programs, libraries and settings. With
# the Python installation they are all of its view: the trainer's data, checkpoints, caches, working
# directory and Unix sockets (/run, /tmp) are nowhere in it, wherever they are.
VISIBLE = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc")
# The device nodes a program needs; the host's others (disks, loop devices, the console) are not there.
DEVICES = ("null", "zero", "full", "random", "urandom")
# SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_KEEP_CAPS_LOCKED and the locks of the first two:
# executing a program as uid 0 gives no capabilities back, and nobody can undo it.
SECURE_BITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20
CAPABILITY_VERSION_3 = 0x20080522
# Root's sandboxes run as uid and gid OWN_UID_BASE + the launcher's pid (real, effective and saved,
# no supplementary groups): unused ids, one per sandbox, owning nothing on the host. Root of a
# container's user namespace, where those are not mapped, runs them as nobody.
OWN_UID_BASE, NOBODY = 2_000_000_000, 65534
# seccomp: socket(AF_UNIX, ...) fails (a Unix socket on the host, such as an inference server's
# ipc:// socket, docker.sock or dbus, would be a way out), and so does io_uring_setup (io_uring
# makes sockets without the socket system call). Abstract Unix sockets belong to the network
# namespace, which is the sandbox's own; socketpair() (a connected pair, no name) stays allowed.
AF_UNIX, EAFNOSUPPORT, ENOSYS = 1, 97, 38
# audit arch, socket, io_uring_setup
SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
X32_SYSCALL_BIT = 0x40000000
SECCOMP_MODE_FILTER, RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 2, 0x7FFF0000, 0x00050000, 0x80000000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
EXIT_SETUP_FAILED = 121
# Values deeper than this do not cross between the solution and the judge (the test fails).
MAX_DEPTH = 100

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")




# ---- launcher: namespaces ----


def enter_namespaces(root_of_machine: bool) -> None:
    """Unshare network, mount, PID, IPC and UTS namespaces; unless root of the machine, inside a user
    namespace of our own (which also makes RLIMIT_NPROC count this sandbox's processes only)."""
    if root_of_machine:
        check(libc.unshare(NAMESPACES), "unshare")
    else:
        uid, gid = os.getuid(), os.getgid()
        check(libc.unshare(CLONE_NEWUSER | NAMESPACES), "unshare")
        # Root inside maps to our own user outside: enough to mount, nothing more.
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    name = b"sandbox"  # not the host's (the UTS namespace is ours to name)
    check(libc.sethostname(name, len(name)), "sethostname")


def refuse(result_fd: int, why: str) -> None:
    """Stop before anything of the solution runs: this sandbox cannot isolate it, and the caller did not
    allow unisolated runs."""
    say(result_fd, {"refused": why})
    os._exit(EXIT_SETUP_FAILED)


def say(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


# ---- the namespace's first process: view, limits, privileges ----


def own_view(workdir: str, limits: dict, owner: int) -> bool:
    """The file system the solution sees (step 3 above), built as a new root on `workdir` (an empty
    folder the trainer made): the folders of `visible_folders`, read-only, a /dev and a /proc of its
    own, and the only writable places, a working directory (at `workdir`'s path) and a /dev/shm, each
    a tmpfs of at most `limits["disk_bytes"]` and `limits["files"]` files, owned by `owner`.

    Returns whether the /proc shows this PID namespace only (where mounting one is allowed)."""
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
    root = workdir
    check(libc.mount(b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m"),
          "mount a tmpfs for the new root")
    try:
        for path in visible_folders():
            show(path, root)
        os.makedirs(root + workdir)
        private_tmpfs(root + workdir, limits, owner, 0o700)
        private_dev(root, limits, owner)
        own_proc = mount_proc(root)
        enter_root(root)
    except OSError:  # the guard runs in the host's view then (where allowed): not in a half-built one
        libc.umount2(root.encode(), MNT_DETACH)
        raise
    set_mount_attr(b"/", AT_RECURSIVE, MountAttr(attr_set=MOUNT_ATTR_RDONLY))
    for writable in (workdir, "/dev/shm"):
        set_mount_attr(writable.encode(), 0, MountAttr(attr_clr=MOUNT_ATTR_RDONLY))
    return own_proc


def visible_folders() -> list[str]:
    """VISIBLE and the Python installation (its prefixes, and the import folders inside them), without
    those inside another. An import folder outside the installation (a repository that a .pth file
    adds) is left out: the solution imports nothing of it, and it may hold the training data."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    imports = {os.path.realpath(path) for path in sys.path if path and os.path.isdir(path)}
    python = prefixes | {path for path in imports if any(within(path, prefix) for prefix in prefixes)}
    folders = sorted({path for path in VISIBLE if os.path.lexists(path)} | python)
    return [path for path in folders if not any(within(path, other) for other in folders if other != path)]


def within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def show(path: str, root: str) -> None:
    """The host's `path` at the same place under `root`: a folder bound there (with the mounts under it),
    a link copied (/bin -> usr/bin)."""
    target = root + path
    os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
        return
    fd = tree_clone(path)
    os.mkdir(target, 0o755)
    move_mount(fd, target)


def mount_proc(root: str) -> bool:
    """A /proc under `root` showing this PID namespace's processes only, mounted while the host's /proc
    is still in this mount namespace (a user namespace may mount one only then); where that is refused
    (a container that masks parts of its /proc), the host's, bound. Returns whether it is our own."""
    os.mkdir(root + "/proc")
    try:
        check(libc.mount(b"proc", f"{root}/proc".encode(), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
              "mount /proc")
        return True
    except OSError:
        move_mount(tree_clone("/proc"), f"{root}/proc")
        return False


def enter_root(root: str) -> None:
    """Make `root` the root of this mount namespace and detach the host's (pivot_root's idiom for a root
    that is the current folder)."""
    os.chdir(root)
    check(libc.pivot_root(b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")


def private_tmpfs(path: str, limits: dict, owner: int, mode: int) -> None:
    options = f"mode={mode:o},uid={owner},gid={owner},size={limits['disk_bytes']},nr_inodes={limits['files']}"
    check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()),
          f"mount a tmpfs on {path}")


def private_dev(root: str, limits: dict, owner: int) -> None:
    """A /dev under `root` with null, zero, full, random and urandom bound from the host's, the usual links
    and a /dev/shm."""
    dev = root + "/dev"
    os.mkdir(dev)
    check(libc.mount(b"tmpfs", dev.encode(), b"tmpfs", MS_NOSUID, b"mode=0755,size=64k"), "mount a tmpfs on /dev")
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{dev}/{name}", "w").close()
            move_mount(tree_clone(f"/dev/{name}"), f"{dev}/{name}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")
    private_tmpfs(f"{dev}/shm", limits, owner, 0o1777)


def tree_clone(path: str) -> int:
    """A detached copy of the mount at `path` (with those under it), to attach elsewhere with `move_mount`."""
    fd = libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | AT_RECURSIVE)
    if fd < 0:
        check(-1, f"open_tree {path}")
    return fd


def move_mount(fd: int, path: str) -> None:
    check(libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, path.encode(), MOVE_MOUNT_F_EMPTY_PATH), f"move_mount {path}")
    os.close(fd)


def set_mount_attr(path: bytes, flags: int, attr: MountAttr) -> None:
    check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path, flags, ctypes.byref(attr), ctypes.sizeof(attr)),
          f"mount_setattr {path.decode()}")


def set_limits(limits: dict, counted_before: int | None) -> None:
    """Memory, file size, a CPU-time backstop, no core files, and the number of processes.

    Args:
        counted_before: processes RLIMIT_NPROC already counts for this sandbox (this one, and the
            launcher inside a user namespace); None when the count would include every process of
            the user, which makes the limit meaningless (the guard refuses new processes then).
    """
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_FSIZE", limits["file_bytes"]),
                        ("RLIMIT_CPU", limits["cpu_seconds"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    if counted_before is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"] + counted_before,) * 2)




def unprivileged_id(launcher_pid: int) -> int | None:
    """The uid and gid root's solution runs as (OWN_UID_BASE and NOBODY); None when not root, which
    has nothing to give up."""
    if os.getuid() != 0:
        return None
    if in_initial_user_namespace():
        return OWN_UID_BASE + launcher_pid
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/self/{name}") as f:
            ranges = [tuple(map(int, line.split())) for line in f]
        if not any(inside <= NOBODY < inside + count for inside, _, count in ranges):
            raise OSError(f"uid 0 cannot be given up here: this user namespace maps no uid {NOBODY} "
                          f"(/proc/self/{name}); map one, or run the trainer as another user")
    return NOBODY


def drop_privileges(own_id: int | None) -> None:
    """Give up every capability for good, also across exec of a program as uid 0; with `own_id`
    (root), also uid 0 itself: real, effective and saved uid and gid become `own_id` and the
    supplementary groups go, so that no root-only file, device or process is reachable and
    RLIMIT_NPROC counts this sandbox's processes alone (Linux exempts real uid 0 from that limit)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    # The securebits first (they need CAP_SETPCAP); SECBIT_NO_SETUID_FIXUP keeps CAP_SETUID through
    # the change of uid until capset empties every set below.
    check(libc.prctl(PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0), "set securebits")
    for cap in range(last_cap + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    if own_id is not None:
        os.setgroups([])
        os.setresgid(own_id, own_id, own_id)
        os.setresuid(own_id, own_id, own_id)
    check(libc.capset(ctypes.byref(CapHeader(CAPABILITY_VERSION_3, 0)), (CapData * 2)()), "capset")


def reachable_imports() -> dict[str, int]:
    """Directory descriptors of the import folders (sys.path) that only root can enter, such as a Python
    under /root/.pyenv, opened while still root. Without a mount namespace nothing binds them where
    the unprivileged uid can reach them; `import_through` has imports go through /proc/self/fd/N
    instead, whose lookup searches no folder above."""
    return {folder: os.open(folder, os.O_RDONLY | os.O_DIRECTORY) for folder in sys.path
            if folder and os.path.isdir(folder) and not others_may_enter(folder)}


def others_may_enter(folder: str) -> bool:
    """Whether a user that owns nothing (neither owner nor group) may list `folder` and every folder above it."""
    path = os.path.realpath(folder)
    above = [path]
    while above[-1] != "/":
        above.append(os.path.dirname(above[-1]))
    return bool(os.stat(path).st_mode & 0o004) and all(os.stat(part).st_mode & 0o001 for part in above)


def import_through(folders: dict[str, int]) -> None:
    """Point sys.path, and the loaded packages' __path__, at the descriptors of `reachable_imports`."""

    def moved(path: str) -> str:
        for folder, fd in folders.items():
            if path == folder or path.startswith(folder + "/"):
                return f"/proc/self/fd/{fd}{path[len(folder):]}"
        return path

    sys.path[:] = [moved(path) for path in sys.path]
    for module in list(sys.modules.values()):
        if isinstance(search := getattr(module, "__path__", None), list):
            search[:] = [moved(path) for path in search]
    sys.path_importer_cache.clear()


def refuse_unix_sockets() -> None:
    """A seccomp filter (see SECCOMP_ARCH); needs no_new_privs. A call from another architecture's
    system call table (x32, 32-bit) kills the process: its numbers are not the ones checked here."""
    arch, socket_nr, io_uring_nr = SECCOMP_ARCH[os.uname().machine]
    program = [
        SockFilter(BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        SockFilter(BPF_JEQ_K, 1, 0, arch),
        SockFilter(BPF_RET_K, 0, 0, RET_KILL_PROCESS),
        SockFilter(BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        SockFilter(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT),
        SockFilter(BPF_RET_K, 0, 0, RET_KILL_PROCESS),
        SockFilter(BPF_JEQ_K, 0, 1, io_uring_nr),
        SockFilter(BPF_RET_K, 0, 0, RET_ERRNO | ENOSYS),
        SockFilter(BPF_JEQ_K, 1, 0, socket_nr),
        SockFilter(BPF_RET_K, 0, 0, RET_ALLOW),
        SockFilter(BPF_LD_W_ABS, 0, 0, 16),  # the low 32 bits of the first argument (little-endian)
        SockFilter(BPF_JEQ_K, 0, 1, AF_UNIX),
        SockFilter(BPF_RET_K, 0, 0, RET_ERRNO | EAFNOSUPPORT),
        SockFilter(BPF_RET_K, 0, 0, RET_ALLOW),
    ]
    filters = (SockFilter * len(program))(*program)
    fprog = SockFprog(len(program), ctypes.cast(filters, ctypes.POINTER(SockFilter)))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "install the seccomp filter")


def in_initial_user_namespace() -> bool:
    with open("/proc/self/uid_map") as f:
        return f.read().split() == ["0", "0", "4294967295"]


def maps_to_root_outside() -> bool:
    """Whether our uid is uid 0 one user namespace up (root in a namespace that maps it to real root:
    Linux then exempts it, and the user namespaces under it, from RLIMIT_NPROC)."""
    uid = os.getuid()
    with open("/proc/self/uid_map") as f:
        for line in f:
            inside, outside, count = map(int, line.split())
            if inside <= uid < inside + count:
                return outside + uid - inside == 0
    return False


# ---- values between the solution and the judge ----

PLAIN = (type(None), bool, float, str)
COLLECTIONS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
BASES = (int, float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict)


def plain(value, other=None, depth: int = 0) -> list:
    """`value` as JSON-ready data tagged with its exact built-in type: None, bool, int, float, complex,
    str, bytes, bytearray, and lists, tuples, sets, frozensets and dicts of them.

    Args:
        other: what describes any other value (the solution's objects become handles); None: such a
            value raises TypeError.
    """
    kind = type(value)
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested more than {MAX_DEPTH} deep")
    if kind in PLAIN:
        return [kind.__name__, value]
    if kind is int:  # in hex: Python's int-to-str conversion stops at 4300 digits, int(x, 16) does not
        return ["int", hex(value)]
    if kind in (bytes, bytearray):
        return [kind.__name__, value.hex()]
    if kind is complex:
        return ["complex", [value.real, value.imag]]
    if COLLECTIONS.get(kind.__name__) is kind:
        return [kind.__name__, [plain(item, other, depth + 1) for item in value]]
    if kind is dict:
        return ["dict", [[plain(k, other, depth + 1), plain(v, other, depth + 1)] for k, v in value.items()]]
    if isinstance(value, BASES):
        return plain(as_base(value), other, depth)
    if other is not None:
        return other(value)
    raise TypeError(f"a {kind.__name__} is not a plain value (None, bool, int, float, str, bytes, or a list, "
                    "tuple, set or dict of them)")


def as_base(value):
    """A subclass of a plain type as that type (a Counter as a dict, a namedtuple as a tuple, an IntEnum
    as an int), as Python compares them, read through the base type's own methods: what the subclass
    overrides (`__eq__`, `__iter__`) plays no part, and what it adds (a namedtuple's `.x`) stays behind."""
    base = next(base for base in BASES if isinstance(value, base))
    if base in (bytes, bytearray):
        return base(memoryview(value))
    if base is dict:
        return dict(dict.items(value))
    if base in (list, tuple, set, frozenset):
        return base(base.__iter__(value))
    return getattr(base, f"__{base.__name__}__")(value)  # int.__int__, float.__float__, str.__str__...


def built(node, remote=None, depth: int = 0):
    """The value `plain` described, checked as it is rebuilt (the other side may send anything);
    ["handle", n] becomes `remote(n)` where given."""
    kind, payload = node
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested more than {MAX_DEPTH} deep")
    if kind == "int" and type(payload) is str:
        return int(payload, 16)
    if kind in ("NoneType", "bool", "str") and type(payload).__name__ == kind:
        return payload
    if kind == "float" and type(payload) in (int, float):
        return float(payload)
    if kind in ("bytes", "bytearray") and type(payload) is str:
        return getattr(builtins, kind).fromhex(payload)
    if kind == "complex" and [type(part) for part in payload] == [float, float]:
        return complex(*payload)
    if kind in COLLECTIONS and type(payload) is list:
        return COLLECTIONS[kind](built(item, remote, depth + 1) for item in payload)
    if kind == "dict" and type(payload) is list:
        return {built(k, remote, depth + 1): built(v, remote, depth + 1) for k, v in payload}
    if kind == "handle" and remote is not None and type(payload) is int:
        return remote(payload)
    raise ValueError(f"not a plain value: {str(node)[:80]}")


def send(stream, message: list) -> None:
    stream.write((json.dumps(message) + "\n").encode())
    stream.flush()


# ---- the solution's process ----


def install_guard(workdir: str) -> None:
    """Refuse what the namespaces would have prevented, from inside Python (bypassable; see the docstring)."""
    workdir = os.path.realpath(workdir)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    refused = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "os.fork", "os.forkpty",
               "os.posix_spawn", "os.spawn", "os.system", "os.exec", "subprocess.Popen", "os.kill", "os.killpg",
               "ctypes.dlopen", "ctypes.dlsym", "sys.addaudithook"}
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                   "os.link", "os.truncate", "os.utime", "shutil.rmtree"}

    def outside(path) -> bool:
        if isinstance(path, int):  # an already open file descriptor
            return False
        full = os.path.realpath(os.fsdecode(path))
        return full != workdir and not full.startswith(workdir + os.sep) and full != os.devnull

    def hook(event: str, args: tuple) -> None:
        if event in refused:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2] or 0
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or flags & write_flags
            if writes and path is not None and outside(path):
                raise PermissionError(f"sandbox: writing {path} outside the working directory is not allowed")
        elif event in path_events and args and outside(args[0]):
            raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

    sys.addaudithook(hook)


# What the judge may ask of a solution's object besides calls and attributes: questions whose answers
# are data. Not `__eq__`, `__contains__` or `__bool__`, which would let the object decide a check
# (`x in obj` iterates instead, and compares in the judge).
SPECIAL = {"__len__": len, "__iter__": iter, "__next__": next, "__getitem__": operator.getitem, "__str__": str}
# Arguments a call may change in place (a list it sorts): sent back to the judge's copy.
MUTABLE = (list, dict, set, bytearray)


def run_solution(spec: dict, guard: bool, channel: tuple[int, int] | None) -> None:
    """Run the solution in this process and, for an assert test, answer the judge over `channel`
    (requests, replies); never returns."""
    is_assert = channel is not None
    if guard:
        install_guard(spec["workdir"])
    namespace = {"__name__": "solution" if is_assert else "__main__", "__builtins__": builtins}
    status = 0
    try:
        exec(compile(spec.pop("code"), "solution.py", "exec"), namespace)
        if is_assert:
            serve(namespace, *channel)
    except SystemExit as e:
        status = 1 if is_assert or e.code not in (None, 0) else 0
        if is_assert:
            print("sandbox: the solution exited before its test ran to the end", file=sys.stderr)
    except BaseException:  # whatever the solution raises is its own failure
        traceback.print_exc()
        status = 1
    end(status)


def end(status: int) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # the solution closed or broke its own streams
        status = status or 1
    os._exit(status)


class Served:
    """The solution's objects the judge holds handles to (a handle is an index here)."""

    def __init__(self):
        self.objects: list = []

    def describe(self, value) -> list:
        return plain(value, self.handle)

    def handle(self, value) -> list:
        if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
            return plain(value.item(), self.handle)  # a numpy scalar (np.int64 from a sum) is a number
        self.objects.append(value)
        return ["handle", len(self.objects) - 1]

    def built(self, node):
        return built(node, self.objects.__getitem__)


def serve(namespace: dict, requests_fd: int, replies_fd: int) -> None:
    """Answer the judge until it closes its end (the test is over), then end this process.

    The first message lists what the solution defines (`defined`); each request is [operation, handle,
    args, kwargs], each answer ["value", description, [[i, argument i changed in place], ...]] or
    ["raised", exception type, message]."""
    served = Served()
    requests, replies = os.fdopen(requests_fd, "rb"), os.fdopen(replies_fd, "wb")
    send(replies, ["ready", defined(namespace, served)])
    for line in requests:
        send(replies, answer(json.loads(line), served))
    end(0)


def defined(namespace: dict, served: Served) -> list:
    """The solution's top-level names: [name, "module", module name] (the judge imports its own copy of a
    standard module the test may use without importing it), or [name, "callable" or "object", handle].
    An object's value is described only when the test asks for it: a module-level table of a million
    primes costs nothing until a test names it."""
    names = []
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            names.append([name, "module", str(value.__name__)])
        else:
            kind = "callable" if callable(value) else "object"
            served.objects.append(value)
            names.append([name, kind, len(served.objects) - 1])
    return names


def answer(request: list, served: Served) -> list:
    operation, target, args, kwargs = request
    try:
        subject, args, kwargs = served.objects[target], served.built(args), served.built(kwargs)
        if operation == "call":
            value = subject(*args, **kwargs)
        elif operation == "value":
            value = subject
        elif operation == "getattr":
            value = getattr(subject, *args)
        else:
            value = SPECIAL[operation](subject, *args)
        changed = [[i, served.describe(arg)] for i, arg in enumerate(args) if type(arg) in MUTABLE]
        return ["value", served.describe(value), [[i, d] for i, d in changed if d != request[2][1][i]]]
    except Exception as e:  # the solution's own exception, which the test may expect
        return ["raised", type(e).__name__, message_of(e)]


def message_of(error: BaseException) -> str:
    try:
        return str(error)[:1000]
    except Exception:  # noqa: BLE001 -- the solution's __str__
        return ""



# ---- the judge ----


# Standard modules whose import does something (opens a browser, prints, starts a GUI): the judge does
# not import them on the solution's word.
SIDE_EFFECTS = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}


class SolutionError(Exception):
    """An exception the solution raised of a type that is not Python's own (its name and message)."""


class SolutionEnded(Exception):
    """The solution's process ended, or broke off its answers, before the test did."""


class Remote:
    """One of the solution's objects, which stays in the solution's process: calling it, reading its
    attributes, iterating or indexing it asks that process, and what comes back is plain data or
    another Remote. A Remote's `==` is identity: no object of the solution's decides a comparison."""

    __slots__ = ("_judge", "_n")

    def __init__(self, judge: "Judge", n: int):
        self._judge, self._n = judge, n

    def __call__(self, *args, **kwargs):
        return self._judge.ask("call", self._n, args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):  # Python's own probes (__length_hint__, __array__) are not the solution's to answer
            raise AttributeError(name)
        return self._judge.ask("getattr", self._n, (name,), {})

    def __repr__(self) -> str:
        return f"<the solution's object #{self._n}>"


def _asks(operation: str):
    def method(self, *args):
        return self._judge.ask(operation, self._n, args, {})

    method.__name__ = operation
    return method


for _operation in SPECIAL:
    setattr(Remote, _operation, _asks(_operation))


class Judge:
    """The test's end of the two pipes to the solution's process."""

    def __init__(self, requests_fd: int, replies_fd: int):
        self.requests, self.replies = os.fdopen(requests_fd, "wb"), os.fdopen(replies_fd, "rb")

    def names(self, used: set) -> tuple[dict, set]:
        """What the solution's module defines, for the test's namespace, and which of it is the solution's
        own (not the standard modules it imported). Of its objects, those the test names (`used`) arrive
        as their values, plain where they are; the others stay Remotes."""
        kind, names = self.receive()
        if kind != "ready":
            raise SolutionEnded("the solution's process sent something else than its names")
        namespace, own = {}, set()
        for name, what, payload in names:
            if what == "module" and payload.partition(".")[0] in sys.stdlib_module_names - SIDE_EFFECTS:
                try:
                    namespace[name] = importlib.import_module(payload)
                except Exception:  # noqa: BLE001 -- a standard module this Python lacks
                    pass
            elif what in ("callable", "object") and type(payload) is int:
                own.add(name)
                used_value = what == "object" and name in used
                namespace[name] = self.ask("value", payload, (), {}) if used_value else Remote(self, payload)
        return namespace, own

    def ask(self, operation: str, n: int, args: tuple, kwargs: dict):
        send(self.requests, [operation, n, self.described(args), self.described(kwargs)])
        reply = self.receive()
        if reply[0] == "raised":
            raise raised(*reply[1:3], operation)
        kind, value, changed = reply
        if kind != "value":
            raise SolutionEnded("the solution's process answered out of turn")
        for i, description in changed:
            refill(args[i], self.built(description))
        return self.built(value)

    def receive(self) -> list:
        line = self.replies.readline()
        if not line:
            raise SolutionEnded("the solution's process ended before its test did (its stderr may say why)")
        message = json.loads(line)
        if type(message) is not list or not message:
            raise SolutionEnded("the solution's process sent a malformed message")
        return message

    def described(self, value) -> list:
        return plain(value, self.handle_of)

    def handle_of(self, value) -> list:
        if type(value) is Remote and value._judge is self:
            return ["handle", value._n]
        raise TypeError(f"the test passes a {type(value).__name__} to the solution: only plain values (and the "
                        "solution's own objects) cross to its process")

    def built(self, node):
        return built(node, lambda n: Remote(self, n))


def raised(name: str, message: str, operation: str) -> Exception:
    """The solution's exception as the test sees it: Python's own type of that name (a test may expect
    ValueError), else a SolutionError. StopIteration ends the test's iteration only from an iterator's
    `__next__`: from a call it would end a `map()` of the test early, as though every item had passed."""
    kind = getattr(builtins, name, None) if type(name) is str else None
    if kind is StopIteration and operation != "__next__":
        return SolutionError(f"{name}: {message}")
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(str(message))
        except Exception:  # noqa: BLE001 -- a type built from other arguments (UnicodeDecodeError)
            pass
    return SolutionError(f"{name}: {message}")


def refill(target, contents) -> None:
    """Give an argument the solution changed in place (a list it sorted) its new contents."""
    if type(target) is not type(contents):
        return
    if isinstance(target, (list, bytearray)):
        target[:] = contents
    else:
        target.clear()
        target.update(contents)


def judge(test: dict, channel: Judge) -> dict:
    """Run the assert test's code against the solution; returns the verdict for the result pipe.

    Args:
        test: {"source": its code, "names": the names it uses, "checks": whether it has an assert, a
            raise or an assert...() call} (the trainer parsed it: `sandbox._test_file`).
    """
    try:
        source, used = test["source"], set(test["names"])
        code = compile(source, "test.py", "exec")
        namespace, own = channel.names(used)
        if why := checks_nothing(test["checks"], used, own):
            return {"verdict": "unverifiable", "why": why}
        module = types.ModuleType("solution")  # for `from solution import f`
        module.__dict__.update({name: namespace[name] for name in own})
        sys.modules["solution"] = module
        linecache.cache["test.py"] = (len(source), None, source.splitlines(True), "test.py")
        exec(code, {"__name__": "__main__", "__builtins__": builtins, **namespace})
        return {"verdict": "passed"}
    except BaseException as e:  # noqa: BLE001 -- a failed check, the solution's failure, a test that exits: all fail it
        print_failure(e)
        return {"verdict": "failed", "why": f"{type(e).__name__}: {e}"[:500]}


def checks_nothing(checks: bool, used: set, own: set) -> str | None:
    """Why the test would pass any solution (no check, or none of what the solution defines), or None."""
    if not checks:
        return "the test checks nothing: it has no assert (or raise) statement"
    if not own & used:
        return f"the test checks nothing the solution defines (it names none of: {', '.join(sorted(own)) or 'nothing'})"
    return None


def print_failure(error: BaseException) -> None:
    """The test's traceback on stderr, with the test's frames only (the judge's own are no use to a reader)."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == "test.py"]
    text = ["Traceback of the test (most recent call last):\n", *traceback.format_list(frames),
            *traceback.format_exception_only(type(error), error)]
    sys.stderr.write("".join(text))
    sys.stderr.flush()



# ---- the three processes ----


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.unlink(sys.argv[1])  # before the solution runs, so that it cannot read the spec
    test_fd = None
    if len(sys.argv) > 2:  # an assert test: opened now, read by the judge once the solution is forked
        test_fd = os.open(sys.argv[2], os.O_RDONLY)
        os.unlink(sys.argv[2])
    memory_cgroup = join_cgroup(spec.get("cgroup_procs"))  # before anything else: every process after is counted
    result_fd = spec["result_fd"]
    facts = {"launcher_pid": os.getpid(), "memory_cgroup": memory_cgroup,
             "root_of_machine": os.getuid() == 0 and in_initial_user_namespace(),
             "root_outside": maps_to_root_outside() and not in_initial_user_namespace()}
    # The kernel's out-of-memory killer takes a solution first, never the trainer for it (inherited below).
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    namespaces, why = False, "switched off"
    if spec["namespaces"]:
        try:
            enter_namespaces(facts["root_of_machine"])
            namespaces, why = True, None
        except OSError as e:
            why = f"no namespaces ({e})"
    if not namespaces and not spec["allow_unisolated"]:
        refuse(result_fd, why)
    # /proc/PID/fd and /proc/PID/mem of this process and of those forked below are closed to processes
    # without CAP_SYS_PTRACE: the solution cannot reach the result pipe through its parents.
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    first = os.fork()  # with namespaces: process 1 of the new PID namespace
    if first:
        exit_like(os.waitpid(first, 0)[1])  # retried on EINTR (PEP 475)
    first_process(spec, result_fd, test_fd, namespaces, why, facts)


def first_process(spec: dict, result_fd: int, test_fd: int | None, namespaces: bool, why: str | None,
                  facts: dict) -> None:
    """Build the solution's view, set its limits, give up privileges, say which isolation holds, then run
    the test (or, for the sandbox's probe, nothing); never returns."""
    root_of_machine = facts["root_of_machine"]
    entered_userns = namespaces and not root_of_machine
    read_only = own_proc = False
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher killed on timeout: all go
        # Root in a user namespace of our own maps to the trainer's own uid: no uid 0 to give up.
        own_id = None if entered_userns else unprivileged_id(facts["launcher_pid"])
        if namespaces:
            try:
                own_proc = own_view(spec["workdir"], spec["limits"], own_id or 0)
                read_only = True
            except OSError as e:
                why = f"no read-only view ({e})"
        if not read_only and not spec["allow_unisolated"]:
            refuse(result_fd, why)
        os.chdir(spec["workdir"])  # the writable mount on top, not the directory under it
        imports = {}
        if not read_only and own_id is not None:
            os.chown(".", own_id, own_id)  # the working directory the trainer made, the solution's now
            imports = reachable_imports()
        set_limits(spec["limits"], 1 if root_of_machine else 2 if entered_userns else None)
        if own_id is not None or namespaces:
            drop_privileges(own_id)
        if imports:
            import_through(imports)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
        refuse_unix_sockets()
    except OSError as e:
        say(result_fd, {"setup_failed": str(e)})
        os._exit(EXIT_SETUP_FAILED)
    guard = not read_only
    say(result_fd, {"isolation": "guard" if guard else "namespaces", "why": why, "own_proc": own_proc,
                    "process_limit": root_of_machine or (entered_userns and not facts["root_outside"]),
                    "memory_cgroup": facts["memory_cgroup"],
                    # Without a PID namespace the trainer ends what the solution left behind by this uid.
                    "own_uid": own_id if guard and root_of_machine else None})
    if spec["kind"] != "probe":
        run_test(spec, result_fd, test_fd, guard)
    os._exit(0)


def run_test(spec: dict, result_fd: int, test_fd: int | None, guard: bool) -> None:
    """Fork the solution's process, then wait for it (a stdio test) or judge it (an assert test); never
    returns."""
    pipes = (os.pipe(), os.pipe()) if test_fd is not None else None  # requests, replies
    try:
        solution = os.fork()
    except OSError as e:
        say(result_fd, {"setup_failed": f"fork: {e}"})
        os._exit(EXIT_SETUP_FAILED)
    if solution == 0:
        # Before anything of the solution runs: the result pipe and the test are the judge's alone.
        os.close(result_fd)
        if pipes is None:
            run_solution(spec, guard, None)
        (requests_read, requests_write), (replies_read, replies_write) = pipes
        for fd in (test_fd, requests_write, replies_read):
            os.close(fd)
        run_solution(spec, guard, (requests_read, replies_write))
    if pipes is None:
        exit_like(os.waitpid(solution, 0)[1])
    (requests_read, requests_write), (replies_read, replies_write) = pipes
    os.close(requests_read)
    os.close(replies_write)
    with os.fdopen(test_fd, encoding="utf-8") as f:
        test = json.load(f)
    remote = Judge(requests_write, replies_read)
    verdict = judge(test, remote)
    say(result_fd, verdict)
    try:
        remote.requests.close()  # the test is over: the solution's process ends
    except OSError:  # it ended already
        pass
    os.waitpid(solution, 0)
    os._exit(0 if verdict["verdict"] == "passed" else 1)


def join_cgroup(procs_file: str | None) -> bool:
    """Move this process into the sandbox's memory cgroup (made by the launcher's caller, see
    `cgroup.py`); its children are born in it. Returns whether it joined."""
    if procs_file is None:
        return False
    try:
        with open(procs_file, "w") as f:
            f.write(str(os.getpid()))
        return True
    except OSError:  # the caller then limits memory per process only, and says so
        return False


def exit_like(status: int) -> None:
    """Exit as the waited-for process did (a signal becomes 128 + its number, as in a shell)."""
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
