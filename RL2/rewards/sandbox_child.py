"""The process a code reward's solution runs in. Started by `RL2.rewards.sandbox`, never imported:

    python -I sandbox_child.py SPEC_JSON

It uses the standard library only, so that it runs before anything else is imported. In order:

1. Read the spec (the solution, one test, the limits) and delete its file, so the solution cannot;
   join the sandbox's memory cgroup where the caller made one (`sandbox_cgroup.py`: one limit on
   the memory of all the processes below).
2. Enter new network, mount and PID namespaces (inside a user namespace of its own unless root of
   the machine): the solution sees no network but a loopback that is down, and its processes end
   with this sandbox.
3. Fork the namespace's first process, which builds the solution's view of the file system
   (`own_view`: read-only, the host's socket and home folders hidden, a /dev of its own, a tmpfs
   working directory), mounts a /proc showing only the sandbox's processes (where allowed), sets
   the resource limits and oom_score_adj, gives up every capability and (as root) uid 0 itself for a
   uid and gid of its own, and installs a seccomp filter against Unix sockets.
4. Fork the solution's process. Its exit status becomes this program's.

When namespaces are unavailable (a container that forbids `unshare`), step 2 is skipped and an audit
hook in the solution's process refuses sockets, new processes, signals, C libraries and writes
outside the working directory instead: a guard against accidents, not a security boundary (code that
reaches C can go around it). The first line written to the result pipe says which isolation was in
effect.
"""

import builtins
import ctypes
import json
import os
import resource
import signal
import sys
import traceback

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x20000000, 0x10000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, AT_FDCWD, AT_RECURSIVE = 0x1, -100, 0x8000
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 0x1, 0x4
# Linux >= 5.12; the same numbers on every architecture but alpha
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 22, 24, 28, 38
# Folders where the host keeps Unix sockets and private files, each covered by an empty tmpfs (the
# Python installation under one of them is bound back, read-only).
HIDDEN = ("/tmp", "/var/tmp", "/run", "/var/run", "/root", "/home", "/mnt", "/media", "/srv")
# The device nodes a program needs; the host's others (disks, loop devices, the console) are not there.
DEVICES = ("null", "zero", "full", "random", "urandom")
# SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_KEEP_CAPS_LOCKED and the locks of the first two:
# executing a program as uid 0 gives no capabilities back, and nobody can undo it.
SECURE_BITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20
CAPABILITY_VERSION_3 = 0x20080522
# Root's sandboxes run as uid and gid OWN_UID_BASE + the launcher's pid (real, effective and saved,
# no supplementary groups): unused ids, one per sandbox, owning nothing on the host.
OWN_UID_BASE = 2_000_000_000
# seccomp: socket(AF_UNIX, ...) fails (a Unix socket on the host, such as an inference server's
# ipc:// socket, docker.sock or dbus, would be a way out), and so does io_uring_setup (io_uring
# makes sockets without the socket system call). Abstract Unix sockets belong to the network
# namespace, which is the sandbox's own; socketpair() (a connected pair, no name) stays allowed.
AF_UNIX, EAFNOSUPPORT, ENOSYS = 1, 97, 38
SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}  # audit arch, socket, io_uring_setup
X32_SYSCALL_BIT = 0x40000000
SECCOMP_MODE_FILTER, RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 2, 0x7FFF0000, 0x00050000, 0x80000000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
EXIT_SETUP_FAILED = 121

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


def enter_namespaces() -> None:
    """Unshare network, mount and PID namespaces; unless root of the machine, inside a user namespace of
    our own (which also makes RLIMIT_NPROC count this sandbox's processes only)."""
    uid, gid = os.getuid(), os.getgid()
    if uid == 0 and in_initial_user_namespace():
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
        return
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
    # Root inside maps to our own user outside: enough to mount, nothing more.
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


# ---- the namespace's first process: view, limits, privileges ----


def own_view(workdir: str, limits: dict, owner: int) -> bool:
    """The file system the solution sees (step 3 above); the only writable places are a working directory
    and a /dev/shm, each a tmpfs of at most `limits["disk_bytes"]` and `limits["files"]` files, owned
    by `owner`. Returns whether a /proc of this PID namespace was mounted."""
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
    hide_host_folders(python_folders())
    os.makedirs(workdir, exist_ok=True)  # in a tmpfs that now covers its parent
    private_tmpfs(workdir, limits, owner, 0o700)
    private_dev(limits, owner)
    try:  # hides the host's processes; a container that masks parts of /proc refuses it to a user namespace
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
        own_proc = True
    except OSError:
        own_proc = False
    set_mount_attr(b"/", AT_RECURSIVE, MountAttr(attr_set=MOUNT_ATTR_RDONLY))
    for writable in (workdir, "/dev/shm"):
        set_mount_attr(writable.encode(), 0, MountAttr(attr_clr=MOUNT_ATTR_RDONLY))
    return own_proc


def python_folders() -> list[str]:
    """The folders this Python imports from (the solution imports after the host's folders are hidden)."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    found.update(path for path in sys.path if path and os.path.isdir(path))
    return sorted({os.path.realpath(path) for path in found})


def hide_host_folders(keep: list[str]) -> None:
    """Cover each folder of `HIDDEN` with an empty read-only tmpfs, binding back the folders of `keep` under it."""
    covered: list[str] = []
    for folder in sorted({os.path.realpath(f) for f in HIDDEN if os.path.isdir(f)}):
        if any(folder == c or folder.startswith(c + "/") for c in covered) or any(k == folder or folder.startswith(k + "/") for k in keep):
            continue  # already covered, or the Python installation itself
        inside = [k for k in keep if k.startswith(folder + "/")]
        clones = [(k, tree_clone(k)) for k in inside]  # taken before the tmpfs hides them
        check(libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m"),
              f"cover {folder}")
        for path, fd in clones:
            os.makedirs(path, 0o755, exist_ok=True)
            move_mount(fd, path)
        covered.append(folder)


def private_tmpfs(path: str, limits: dict, owner: int, mode: int) -> None:
    options = f"mode={mode:o},uid={owner},gid={owner},size={limits['disk_bytes']},nr_inodes={limits['files']}"
    check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()), f"mount a tmpfs on {path}")


def private_dev(limits: dict, owner: int) -> None:
    """A /dev with null, zero, full, random and urandom bound from the host's, the usual links and a /dev/shm."""
    nodes = [(name, tree_clone(f"/dev/{name}")) for name in DEVICES if os.path.exists(f"/dev/{name}")]
    check(libc.mount(b"tmpfs", b"/dev", b"tmpfs", MS_NOSUID, b"mode=0755,size=64k"), "mount a tmpfs on /dev")
    for name, fd in nodes:
        open(f"/dev/{name}", "w").close()
        move_mount(fd, f"/dev/{name}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    private_tmpfs("/dev/shm", limits, owner, 0o1777)


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


def drop_privileges(own_id: int | None, keep_root: bool = False) -> None:
    """Give up every capability for good, also across exec of a program as uid 0; with `own_id`
    (root of the machine), also uid 0 itself: real, effective and saved uid and gid become `own_id`
    and the supplementary groups go, so that no root-only file, device or process is reachable and
    RLIMIT_NPROC counts this sandbox's processes alone (Linux exempts real uid 0 from that limit)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    # The securebits first (they need CAP_SETPCAP); SECBIT_NO_SETUID_FIXUP keeps CAP_SETUID through
    # the change of uid until capset empties every set below.
    check(libc.prctl(PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0), "set securebits")
    for cap in range(last_cap + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    if own_id is not None and keep_root:
        # Without a mount namespace the Python installation may sit in root-only folders (/root):
        # only the real uid changes (the weak mode, which the user opted into).
        check(libc.setresuid(own_id, 0, 0), "setresuid")
    elif own_id is not None:
        os.setgroups([])
        os.setresgid(own_id, own_id, own_id)
        os.setresuid(own_id, own_id, own_id)
    check(libc.capset(ctypes.byref(CapHeader(CAPABILITY_VERSION_3, 0)), (CapData * 2)()), "capset")


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


# The grader's own references, taken before any solution runs: a solution that replaces
# `builtins.exec` or `os.write` changes what its own code calls, not what runs and reports its test.
_exec, _eval, _compile, _write, _dumps = builtins.exec, builtins.eval, builtins.compile, os.write, json.dumps
PLAIN = (type(None), bool, int, float, str)


def plain(value, depth: int = 0) -> list:
    """`value` as JSON, tagged with its exact type, for the launcher to rebuild and compare.

    Only built-in values pass (None, bool, int, float, str, bytes, and lists, tuples, sets and dicts
    of them): an object of the solution's own class, whose `==` could say anything, fails its test.
    """
    kind = type(value)
    if depth > 100:
        raise ValueError("the test's value is nested more than 100 deep")
    if kind in PLAIN:
        return [kind.__name__, value]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [plain(item, depth + 1) for item in value]]
    if kind is dict:
        return ["dict", [[plain(k, depth + 1), plain(v, depth + 1)] for k, v in value.items()]]
    raise TypeError(f"the test compares a {kind.__name__}, not a built-in value (int, str, list, ...)")


def run_solution(spec: dict, result_fd: int, guard: bool) -> None:
    """Run the solution (and an assert test's steps after it) in this process; never returns.

    An assert test arrives as steps: statements to run, and expressions to evaluate (the
    solution-dependent sides of its asserts; the expected values stay in the launcher). The values,
    serialised by `plain`, are written to the result pipe once every step ran, and the launcher
    compares them: nothing the solution can read here (the steps are in this frame) or return (an
    object whose `==` is always true) makes a test pass without the right values.
    """
    is_assert = spec["kind"] == "assert"
    solution = _compile(spec.pop("code"), "solution.py", "exec")
    steps = [(kind, _compile(source, "test.py", "exec" if kind == "exec" else "eval")) for kind, source in spec.pop("steps")]
    if guard:
        install_guard(spec["workdir"])
    namespace = {"__name__": "solution" if is_assert else "__main__", "__builtins__": builtins}
    status = 0
    try:
        _exec(solution, namespace)
        if is_assert:
            values = []
            for kind, step in steps:
                if kind == "exec":
                    _exec(step, namespace)
                else:
                    values.append(plain(_eval(step, namespace)))
            sys.stdout.flush()
            # Written only once the test ran to its end: exiting early (sys.exit(0)) does not pass.
            _write(result_fd, (_dumps({"values": values}) + "\n").encode())
    except SystemExit as e:
        status = 1 if is_assert or e.code not in (None, 0) else 0
        if is_assert:
            print("sandbox: the solution exited before its test ran to the end", file=sys.stderr)
    except BaseException:  # whatever the solution raises is its own failure
        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # the solution closed or broke its own streams
        status = status or 1
    os._exit(status)


# ---- the three processes ----


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.unlink(sys.argv[1])  # before the solution runs, so that it cannot read the spec
    memory_cgroup = join_cgroup(spec.get("cgroup_procs"))  # before anything else: every process after is counted
    launcher_pid, result_fd = os.getpid(), spec["result_fd"]
    namespaces = bool(spec["namespaces"])
    why = None if namespaces else "switched off"
    root_outside = maps_to_root_outside() and not in_initial_user_namespace()
    if namespaces:
        try:
            enter_namespaces()
        except OSError as e:
            namespaces, why = False, f"no namespaces ({e})"
    first = os.fork()  # with namespaces: process 1 of the new PID namespace
    if first:
        exit_like(os.waitpid(first, 0)[1])  # retried on EINTR (PEP 475)
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher killed on timeout: all go
        # The kernel's out-of-memory killer takes a solution first, never the trainer for it.
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        own_uid = os.getuid() == 0 and in_initial_user_namespace()
        own_id = OWN_UID_BASE + launcher_pid if own_uid else None
        read_only = own_proc = False
        if namespaces:
            try:
                own_proc = own_view(spec["workdir"], spec["limits"], own_id or 0)
                read_only = True
            except OSError as e:
                why = f"no read-only view ({e})"
        os.chdir(spec["workdir"])  # the writable mount on top, not the directory under it
        set_limits(spec["limits"], 1 if own_uid else 2 if namespaces else None)
        if own_uid or namespaces:
            drop_privileges(own_id, keep_root=not read_only)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
        refuse_unix_sockets()
    except OSError as e:
        os.write(result_fd, (json.dumps({"setup_failed": str(e)}) + "\n").encode())
        os._exit(EXIT_SETUP_FAILED)
    guard = not (namespaces and read_only)
    report = {"isolation": "guard" if guard else "namespaces", "why": why, "own_proc": own_proc,
              "process_limit": own_uid or (namespaces and not root_outside), "memory_cgroup": memory_cgroup}
    os.write(result_fd, (json.dumps(report) + "\n").encode())  # first, before the solution can write
    try:
        solution = os.fork()
    except OSError as e:
        os.write(result_fd, (json.dumps({"setup_failed": f"fork: {e}"}) + "\n").encode())
        os._exit(EXIT_SETUP_FAILED)
    if solution == 0:
        run_solution(spec, result_fd, guard)
    exit_like(os.waitpid(solution, 0)[1])


def join_cgroup(procs_file: str | None) -> bool:
    """Move this process into the sandbox's memory cgroup (made by the launcher's caller, see
    `sandbox_cgroup.py`); its children are born in it. Returns whether it joined."""
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
