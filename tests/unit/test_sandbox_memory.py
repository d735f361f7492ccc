"""The code sandbox's memory limit on all its processes together (a memory cgroup per run), its
removal after each run, and the per-process limit (RLIMIT_AS) where no cgroup can be made.

The cgroup tests run as root on a machine with a writable memory cgroup (CI's), and are skipped
elsewhere with the reason."""

import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest

from RL2.sandbox import CodeLimits, CodeTest, Sandbox
from RL2.sandbox.cgroup import DEFAULT_ROOT, find_parent

LIMIT_MB = 128
LIMITS = CodeLimits(timeout_s=10.0, memory_mb=LIMIT_MB, max_processes=8, max_file_mb=1, max_output_kb=64)
CHILDREN, CHILD_MB = 3, 56  # each below LIMIT_MB (and its address-space limit), together above it

# Each child allocates and touches CHILD_MB, says so, and holds it until all have: the memory of all
# the children is in use at once. Prints how many got there and their exit statuses.
TOGETHER = f"""
import os
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
pids = []
for _ in range({CHILDREN}):
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        block = b"x" * ({CHILD_MB} * 2**20)
        os.write(ready_w, b"1")
        os.close(ready_w)
        os.read(go_r, 1)  # until the parent closes its end
        os._exit(0)
    pids.append(pid)
os.close(ready_w)
os.close(go_r)
ready = 0
while os.read(ready_r, 1):
    ready += 1
os.close(go_w)
print(ready, [os.waitpid(pid, 0)[1] for pid in pids])
"""
ALL_HELD = CodeTest(output=f"{CHILDREN} {[0] * CHILDREN}")
# The sandbox's memory cgroup, as the solution sees it (its path in the v1 memory hierarchy).
OWN_MEMORY_CGROUP = "print([line.split(':')[2] for line in open('/proc/self/cgroup') if ':memory:' in line][0])"


def own_memory_cgroup() -> Path | None:
    """This process's v1 memory cgroup, read here, independently of the sandbox's code."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path(DEFAULT_ROOT, "memory", path.lstrip("/"))
    return None


def namespaced(sandbox: Sandbox) -> Sandbox:
    probe = sandbox.run_blocking("print('hi')", CodeTest(output="hi"))
    if probe.isolation != "namespaces":  # the guard refuses the processes these tests start
        pytest.skip(f"this system refuses Linux namespaces (isolation: {probe.isolation})")
    return sandbox


@pytest.fixture(scope="module")
def cgroup_parent():
    if os.getuid() != 0:
        pytest.skip("a memory cgroup per sandbox needs root (or a delegated cgroup) here")
    parent, why = find_parent()
    if parent is None:
        pytest.skip(f"no writable memory cgroup on this machine ({why})")
    return parent


@pytest.fixture(scope="module")
def sandbox(cgroup_parent) -> Sandbox:
    return namespaced(Sandbox(LIMITS, max_concurrency=2))


@pytest.fixture
def per_process(tmp_path) -> Sandbox:
    """A sandbox pointed at a folder that holds no cgroup file system."""
    return namespaced(Sandbox(LIMITS, max_concurrency=2, cgroup_root=str(tmp_path)))


def sandbox_cgroups(parent: Path) -> set[str]:
    return {path.name for path in parent.glob("rl2-sandbox-*")}


def test_processes_together_are_held_to_the_sandbox_limit(sandbox):
    result = sandbox.run_blocking(TOGETHER, ALL_HELD)
    assert result.memory_scope == "sandbox"
    assert result.status != "passed", result.stdout
    assert "out of memory" in result.stderr and f"memory_mb ({LIMIT_MB} MB)" in result.stderr
    # The same program within a limit that holds the three blocks: it is their sum that failed.
    roomy = Sandbox(replace(LIMITS, memory_mb=3 * LIMIT_MB), max_concurrency=1)
    fits = roomy.run_blocking(TOGETHER, ALL_HELD)
    assert (fits.status, fits.memory_scope, fits.stderr) == ("passed", "sandbox", "")


def test_each_run_has_its_own_cgroup_and_leaves_none(sandbox, cgroup_parent):
    own = own_memory_cgroup()
    assert own == cgroup_parent.path
    before = sandbox_cgroups(own)
    seen = set()
    for _ in range(5):
        result = sandbox.run_blocking(OWN_MEMORY_CGROUP, CodeTest(output=''))
        path = Path(DEFAULT_ROOT, "memory", result.stdout.strip().lstrip("/"))
        assert path.parent == own and path.name.startswith("rl2-sandbox-"), result.stdout
        assert not path.exists()
        seen.add(path)
    assert len(seen) == 5
    # Runs cut short, and a process left behind in a session of its own, leave no cgroup either.
    left_behind = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    quick = Sandbox(replace(LIMITS, timeout_s=1.0), max_concurrency=1)
    assert quick.run_blocking("while True:\n    pass", CodeTest(output="")).status == "timeout"
    assert quick.run_blocking(left_behind, CodeTest(output="done")).status == "passed"
    assert sandbox.run_blocking(TOGETHER, ALL_HELD).status != "passed"
    for _ in range(10):
        sandbox.run_blocking("print('hi')", CodeTest(output="hi"))
    assert sandbox_cgroups(own) == before


def test_without_a_cgroup_each_process_is_still_limited(per_process, caplog):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="RL2.sandbox.runner"):
        warned = Sandbox(LIMITS, max_concurrency=1, cgroup_root="/nonexistent")
        big = warned.run_blocking(f"x = bytearray({2 * LIMIT_MB} * 2**20)\nprint('allocated')",
                                  CodeTest(output="allocated"))
        warned.run_blocking("print('hi')", CodeTest(output="hi"))
    assert big.memory_scope == "process"
    assert big.status == "error" and "MemoryError" in big.stderr
    assert [r.message.count("without a memory cgroup") for r in caplog.records] == [1]
    # The sum of the processes is then bounded by their number only.
    together = per_process.run_blocking(TOGETHER, ALL_HELD)
    assert (together.status, together.memory_scope) == ("passed", "process")


def test_a_folder_that_looks_like_a_cgroup_is_not_used(tmp_path):
    own = tmp_path / "memory" / "trainer"
    own.mkdir(parents=True)
    (own / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    own_cgroups = tmp_path / "cgroup"
    own_cgroups.write_text("4:memory:/trainer\n0::/\n")
    parent, why = find_parent(str(tmp_path), str(own_cgroups))
    assert parent is not None and parent.path == own  # found where /proc/self/cgroup points
    sandbox = Sandbox(LIMITS, max_concurrency=1, namespaces=False, allow_unisolated=True)
    sandbox._cgroup_parent = parent  # a plain folder: mkdir makes no cgroup files there
    result = sandbox.run_blocking("print('hi')", CodeTest(output="hi"))
    assert (result.status, result.memory_scope) == ("passed", "process")
    assert list(own.iterdir()) == [own / "memory.limit_in_bytes"]  # the folder it made is gone


def test_find_parent_reads_cgroup_v2(tmp_path):
    own = tmp_path / "a" / "b"
    own.mkdir(parents=True)
    own_cgroups = tmp_path / "cgroup"
    own_cgroups.write_text("0::/a/b\n")
    (own / "cgroup.controllers").write_text("cpu io pids\n")
    assert find_parent(str(tmp_path), str(own_cgroups))[0] is None  # no memory controller
    (own / "cgroup.controllers").write_text("cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("memory\n")
    parent, _ = find_parent(str(tmp_path), str(own_cgroups))
    assert (parent.path, parent.version) == (own, 2)


def test_a_cgroup_the_sandbox_cannot_join_leaves_the_per_process_limit(cgroup_parent, monkeypatch, caplog):
    spec = Sandbox._spec

    def unjoinable(self, *args):
        return {**spec(self, *args), "cgroup_procs": "/proc/no-such-cgroup/cgroup.procs"}

    monkeypatch.setattr(Sandbox, "_spec", unjoinable)
    box = namespaced(Sandbox(LIMITS, max_concurrency=1))
    before = sandbox_cgroups(cgroup_parent.path)
    with caplog.at_level(logging.WARNING, logger="RL2.sandbox.runner"):
        together = box.run_blocking(TOGETHER, ALL_HELD)
    assert (together.status, together.memory_scope) == ("passed", "process")
    assert any("could not join" in record.message for record in caplog.records)
    assert sandbox_cgroups(cgroup_parent.path) == before  # made, unused, removed all the same
