"""The code sandbox where the system refuses namespaces, as Docker's default seccomp profile and most
Kubernetes pods do: simulated by a seccomp filter that makes `unshare` (or, namespaces granted, the
`pivot_root` that builds the solution's view) fail with EPERM, installed in a fresh process that then
uses the sandbox as the trainer would (the filter is inherited, as a container's).

A solution that goes around the in-process guard (sqlite3 writes files, `_posixsubprocess` starts
processes, reads are never refused) must not run at all where unisolated runs are not allowed, and
must not run as uid 0 where they are."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="seccomp numbers known here")

# Installs a filter that makes one system call fail with EPERM, then runs a solution twice in a Sandbox
# that allows unisolated runs or not; prints what each run gave and how many sandbox processes started.
HOST = r"""
import ctypes, json, os, subprocess, sys

ARCH, NUMBERS = {"x86_64": (0xC000003E, {"unshare": 272, "pivot_root": 155}),
                 "aarch64": (0xC00000B7, {"unshare": 97, "pivot_root": 41})}[os.uname().machine]
REFUSED = NUMBERS[sys.argv[3]]

class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]

rules = [Filter(0x20, 0, 0, 4), Filter(0x15, 0, 3, ARCH), Filter(0x20, 0, 0, 0), Filter(0x15, 0, 1, REFUSED),
         Filter(0x06, 0, 0, 0x00050000 | 1), Filter(0x06, 0, 0, 0x7FFF0000)]
array = (Filter * len(rules))(*rules)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs: what a filter needs without CAP_SYS_ADMIN
assert libc.prctl(22, 2, ctypes.byref(Program(len(rules), ctypes.cast(array, ctypes.POINTER(Filter)))), 0, 0) == 0

from RL2.sandbox import CodeLimits, CodeTest, Sandbox, SandboxError

starts = []
real_popen = subprocess.Popen

class CountingPopen(real_popen):
    def __init__(self, *args, **kwargs):
        starts.append(args[0])
        super().__init__(*args, **kwargs)

subprocess.Popen = CountingPopen
sandbox = Sandbox(CodeLimits(timeout_s=5.0), max_concurrency=1, allow_unisolated=sys.argv[1] == "allow",
                  cgroup_root=None)
outcomes = []
for _ in range(2):
    try:
        result = sandbox.run_blocking(sys.argv[2], CodeTest(output=""))
        outcomes.append({"status": result.status, "stdout": result.stdout, "stderr": result.stderr,
                         "isolation": result.isolation})
    except SandboxError as e:
        outcomes.append({"refused": str(e)})
print(json.dumps({"outcomes": outcomes, "starts": len(starts)}))
"""


def attack(private: str, public: str) -> str:
    """A solution that reads /etc/shadow, writes what it read into a root-only folder and leaves a process
    behind in a session of its own, all without an audited call the guard refuses."""
    plant, pid_file = os.path.join(private, "planted.db"), os.path.join(public, "leftover.pid")
    leftover = (f"import os, time\nos.closerange(0, 3)\nopen({pid_file!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
                "time.sleep(20)\n")
    return f"""
import os, sqlite3, sys, _posixsubprocess
try:
    secret = str(len(open('/etc/shadow').read()))
except OSError as e:
    secret = 'refused ' + type(e).__name__
print('euid', os.geteuid(), 'shadow', secret)
try:
    db = sqlite3.connect({plant!r})
    db.execute('create table t(x)')
    db.execute('insert into t values (?)', (secret,))
    db.commit()
    print('planted')
except Exception as e:
    print('plant refused', type(e).__name__)
r, w = os.pipe()
_posixsubprocess.fork_exec([sys.executable, '-c', {leftover!r}], [os.fsencode(sys.executable)], True, (w,),
                           None, None, -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)
"""


def run_host(allow: bool, code: str, refused: str = "unshare") -> dict:
    completed = subprocess.run([sys.executable, "-c", HOST, "allow" if allow else "deny", code, refused],
                               capture_output=True, text=True, timeout=120,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.splitlines()[-1])


@pytest.fixture
def folders(tmp_path):
    """A root-only folder (the solution must not write there) and a world-writable one (where a leftover
    process, whatever its uid, says it is alive); leftovers are killed afterwards."""
    private, public = tmp_path / "private", tmp_path / "public"
    private.mkdir(mode=0o700)
    public.mkdir()
    os.chmod(public, 0o777)
    os.chmod(tmp_path, 0o755)
    yield str(private), str(public)
    pid_file = public / "leftover.pid"
    for pid in pid_file.read_text().split() if pid_file.exists() else []:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def alive(pid_file: str, wait_s: float = 1.0) -> bool:
    """Whether a leftover process wrote its pid within `wait_s` and one that did still runs."""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(pid_file) or not open(pid_file).read().strip():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    for pid in open(pid_file).read().split():
        try:
            os.kill(int(pid), 0)
            return True
        except ProcessLookupError:
            pass
    return False


@pytest.mark.skipif(os.getuid() != 0, reason="the trainer as root, as in most containers")
@pytest.mark.parametrize("refused", ["unshare", "pivot_root"])
def test_refused_namespaces_run_nothing_unless_allowed(folders, refused):
    private, public = folders
    outcome = run_host(False, attack(private, public), refused)
    assert not os.path.exists(os.path.join(private, "planted.db")), "the solution ran (as root) before the refusal"
    assert not alive(os.path.join(public, "leftover.pid")), "the solution ran and left a process behind"
    first, second = outcome["outcomes"]
    assert "refused" in first and first == second, outcome
    assert "allow_unisolated=True" in first["refused"] and "seccomp=unconfined" in first["refused"]
    assert outcome["starts"] == 1  # one probe at the first use; the second run is refused without a process


@pytest.mark.skipif(os.getuid() != 0, reason="the trainer as root, as in most containers")
@pytest.mark.parametrize("refused", ["unshare", "pivot_root"])
def test_allowed_unisolated_runs_give_up_uid_0(folders, refused):
    private, public = folders
    outcome = run_host(True, attack(private, public), refused)
    for result in outcome["outcomes"]:
        assert result["isolation"] == "guard", result
        said = result["stdout"].split()
        assert said[:2] != ["euid", "0"] and "shadow refused" in result["stdout"], result
        assert "plant refused" in result["stdout"], result
    assert not os.path.exists(os.path.join(private, "planted.db"))
    assert not alive(os.path.join(public, "leftover.pid"), wait_s=0.5), "a leftover process outlived its run"


def test_allowed_unisolated_runs_still_import_and_pass():
    # The unprivileged uid imports the standard library even where Python sits in a root-only home (/root).
    code = "import heapq, fractions, decimal\nprint(heapq.nsmallest(1, [3, 1]), fractions.Fraction(1, 2))"
    outcome = run_host(True, code)
    for result in outcome["outcomes"]:
        assert result["stdout"].split() == ["[1]", "1/2"], result
