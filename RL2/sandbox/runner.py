"""Run a policy's Python code against one test in a separate, isolated, limited process.

Each test runs in a fresh process (`child.py`, which describes the isolation, and
docs/rewards.md): namespaces, a read-only file system but for a temporary working directory,
resource limits, no capabilities, none of the trainer's variables and, where the machine allows it
(`cgroup.py`), a memory cgroup of its own. The wall-clock limit is enforced from here: on
timeout the process group is killed, and with it the PID namespace (every process the solution
started, even one that left the group). An assert test is judged in the sandbox by a process that
never runs solution code; only its verdict comes back here, on a pipe the solution never holds.

The waiting happens in a thread pool of `max_concurrency` threads, so an event loop stays free
(`await sandbox.run(...)`) and at most that many solutions run at once. A solution that hangs,
crashes, floods its output or exhausts its limits fails its test; only a sandbox that cannot start
at all, or cannot isolate solutions where unisolated runs are not allowed (found once, before the
first solution runs), raises `SandboxError`.
"""

import ast
import asyncio
import contextlib
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from RL2.sandbox.cgroup import DEFAULT_ROOT, SandboxCgroup, find_parent

CHILD = Path(__file__).with_name("child.py")
# The child is loaded from its bytecode cache: a script run as __main__ is compiled anew at every start,
# which for this one costs more than the rest of its start together.
BOOT = ("import importlib.machinery as machinery\n"
        f"path = {str(CHILD)!r}\n"
        "exec(machinery.SourceFileLoader('child', path).get_code('child'), "
        "{'__name__': '__main__', '__file__': path})\n")
STDERR_TAIL = 4096
READ_CHUNK = 65536
RESULT_LIMIT = 65536  # of the result pipe's lines (a report and a verdict), kept

log = logging.getLogger(__name__)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the solution): it could not start or isolate the process."""


@dataclass
class CodeLimits:
    """Limits of one test run (docs/rewards.md says how each is enforced).

    Attributes:
        timeout_s: wall-clock seconds, Python's start included.
        memory_mb: the memory of all the sandbox's processes and the files they write together, where
            a cgroup can be made; and each process's address space (RLIMIT_AS).
        max_processes: processes and threads of the solution, itself included (RLIMIT_NPROC).
        max_file_mb: the largest file it may write (RLIMIT_FSIZE).
        max_disk_mb: all it may write, its working directory and /dev/shm each (a tmpfs of that size,
            which counts as memory of the machine while the test runs).
        max_files: files and folders in its working directory and in /dev/shm, each.
        max_output_kb: standard output kept; more fails the test.
    """

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_processes: int = 16
    max_file_mb: int = 16
    max_disk_mb: int = 64
    max_files: int = 1000
    max_output_kb: int = 1024


@dataclass
class CodeTest:
    """One test: standard input and the expected standard output, or assert code run after the solution.

    With `assert_code`, the solution runs as a module named "solution" (its `if __name__ ==
    "__main__":` block is skipped) and the test passes when the assert code runs to its end. The
    assert code runs in a process of its own, where the solution's names stand for its functions and
    objects, reached only through plain values (`child.Remote`); a test that checks nothing
    (no assert, or none of the solution's names) fails.
    """

    input: str = ""
    output: str | None = None
    assert_code: str | None = None

    def __post_init__(self):
        if (self.output is None) == (self.assert_code is None):
            raise ValueError("a code test has either an expected output or assert code, not both or neither")


@dataclass
class TestResult:
    """Attributes:
        status: passed | wrong_answer (ran, printed something else) | error (an exception, a failed
            assert, a non-zero exit, a limit hit) | timeout | output_limit.
        seconds: wall-clock time of the run.
        stdout: what the solution printed (at most max_output_kb).
        stderr: the end of its standard error (tracebacks).
        isolation: "namespaces", or "guard" when only the in-process guard was available.
        memory_scope: "sandbox" when a cgroup bounded the memory of all its processes together,
            "process" when only each process's address space was bounded (RLIMIT_AS), "unknown"
            when the run was cut short before the sandbox reported.
    """

    __test__ = False  # not a pytest test class

    status: str
    seconds: float
    stdout: str
    stderr: str
    isolation: str
    memory_scope: str = "unknown"

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def default_concurrency() -> int:
    """The CPU cores of this host divided among the ranks that share it (torchrun's LOCAL_WORLD_SIZE)."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


class Sandbox:
    """Runs code against tests, at most `max_concurrency` at a time.

    Args:
        limits: the limits of each test run.
        max_concurrency: test runs at once (default: `default_concurrency()`).
        namespaces: isolate with Linux namespaces when the system allows it; False runs with the
            in-process guard only (to test that guard; needs `allow_unisolated`).
        allow_unisolated: where namespaces are refused (Docker's default seccomp profile, most
            Kubernetes pods), run solutions with only an in-process audit hook, which is no
            isolation (code that reaches C goes around it); False (the default) raises
            `SandboxError` there instead.
        cgroup_root: where the cgroup file systems are mounted (`cgroup.py`); where no
            cgroup can be made, or with None, memory is bounded per process only (said once).
    """

    def __init__(self, limits: CodeLimits | None = None, max_concurrency: int | None = None, namespaces: bool = True,
                 allow_unisolated: bool = False, cgroup_root: str | None = DEFAULT_ROOT):
        self.limits = limits or CodeLimits()
        self.namespaces = namespaces
        self.allow_unisolated = allow_unisolated
        self.max_concurrency = max_concurrency or default_concurrency()
        self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rl2-sandbox")
        self._warned: set[str] = set()  # what has been said once
        self._probe_lock = threading.Lock()
        self._probed = False
        self._refusal: str | None = None  # why every run is refused, once the probe found it
        self._cgroup_parent, why = find_parent(cgroup_root) if cgroup_root else (None, "switched off")
        if self._cgroup_parent is None:
            self._warn_memory_per_process(why)

    async def run(self, code: str, test: CodeTest) -> TestResult:
        """Run `code` against `test` without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.run_blocking, code, test)

    async def run_tests(self, code: str, tests: list[CodeTest], stop_at_failure: bool = False) -> list[TestResult]:
        """Run the tests one after another; with `stop_at_failure`, stop at the first that fails."""
        results = []
        for test in tests:
            results.append(await self.run(code, test))
            if stop_at_failure and not results[-1].passed:
                break
        return results

    def run_blocking(self, code: str, test: CodeTest) -> TestResult:
        """Run `code` against `test` in this thread."""
        self._probe()
        run = self._launch(code, "assert" if test.assert_code is not None else "stdio", test)
        report = self._report_of(run)
        status, stderr = run.status, run.stderr
        if status is None and test.assert_code is not None:
            status, stderr = self._judged(run.verdict, stderr)
        elif status is None:
            status = _verdict(test, run.stdout, run.returncode)
        if run.oom_kills:
            stderr += (f"sandbox: out of memory: its processes together reached memory_mb ({self.limits.memory_mb} "
                       f"MB) and the kernel killed {run.oom_kills} of them\n")
        memory_scope = ("sandbox" if report.get("memory_cgroup") else "process") if report else "unknown"
        return TestResult(status, run.seconds, run.stdout, stderr, report["isolation"] if report else "unknown",
                          memory_scope)

    def _probe(self) -> None:
        """Once, before the first solution runs: start a sandbox that runs nothing, to learn whether this
        system isolates solutions. Where it does not and unisolated runs are not allowed, that run and
        every later one raise the same `SandboxError`, without starting a process."""
        with self._probe_lock:
            if not self._probed:
                run = self._launch("", "probe", None)
                if run.refused is not None:
                    self._refusal = _refusal_message(run.refused)
                    log.error("%s", self._refusal)
                else:
                    self._report_of(run)  # raises where the sandbox cannot start: probed again next time
                self._probed = True
        if self._refusal is not None:
            raise SandboxError(self._refusal)

    def _launch(self, code: str, kind: str, test: CodeTest | None) -> "_Run":
        """Start one sandbox (kind "stdio", "assert" or "probe") and wait for it; its working directory,
        cgroup and (without a PID namespace) leftover processes are gone when this returns."""
        workdir = tempfile.mkdtemp(prefix="rl2-sandbox-")
        read_end, write_end = os.pipe()  # the report and the verdict, written by the sandbox's own processes
        cgroup = self._new_cgroup(Path(workdir).name)
        oom_kills = 0
        try:
            try:
                files = [Path(workdir) / ".spec.json"]
                files[0].write_text(json.dumps(self._spec(code, kind, workdir, write_end, cgroup)))
                if kind == "assert":  # read by the judge only (child.py, step 1)
                    files.append(Path(workdir) / ".test.json")
                    files[1].write_text(json.dumps(_test_file(test.assert_code)))
                stdin = test.input if kind == "stdio" else None
                began = time.monotonic()
                process = self._start(files, stdin, workdir, write_end)
            finally:
                os.close(write_end)  # the child has its copy
            stdout, stderr, result, status = self._wait(process, read_end, stdin or "", began)
            run = _Run(status, stdout, stderr, process.returncode, time.monotonic() - began, _lines(result),
                       str(cgroup.path) if cgroup is not None else None)
            if run.report and run.report.get("own_uid"):
                _kill_processes_of(run.report["own_uid"])
        finally:
            os.close(read_end)
            if cgroup is not None:
                oom_kills = cgroup.remove()  # with whatever the solution left behind
            _remove(workdir)
        run.oom_kills = oom_kills
        return run

    def _report_of(self, run: "_Run") -> dict | None:
        """The sandbox's report of its isolation, or None when a limit cut the run short before it came.

        Raises SandboxError where the sandbox refused to run the solution unisolated, or could not start it."""
        if run.refused is not None:
            raise SandboxError(_refusal_message(run.refused))
        if run.report is None or run.setup_failed is not None:
            if run.status is None:  # not cut short by a limit: it ended before the solution could start
                why = run.setup_failed or f"status {run.returncode}: {run.stderr.strip()[-500:]}"
                raise SandboxError(f"the code sandbox could not start the solution ({why})")
            return None
        self._warn_about(run.report)
        if run.cgroup is not None and not run.report.get("memory_cgroup"):
            self._warn_memory_per_process(f"the sandbox could not join {run.cgroup}")
        return run.report

    def _judged(self, verdict: dict | None, stderr: str) -> tuple[str, str]:
        """An assert test's status from the judge's verdict, and its stderr with why where the test checks nothing."""
        if verdict is None:
            return "error", stderr + "sandbox: the test was not judged (its judge ended without a verdict)\n"
        if verdict.get("verdict") == "unverifiable":
            self._warn_once("unverifiable", "code sandbox: %s, so it would pass any solution: such tests fail (reward "
                            "0) until the data set's tests assert something of the solution's functions",
                            verdict.get("why"))
            return "error", stderr + f"sandbox: {verdict.get('why')}: it is not passed\n"
        return ("passed" if verdict.get("verdict") == "passed" else "error"), stderr

    def _new_cgroup(self, name: str) -> SandboxCgroup | None:
        """A memory cgroup for one test run, or None where none can be made (said once)."""
        if self._cgroup_parent is None:
            return None
        try:
            # pids.max also counts the launcher and the PID namespace's first process.
            return SandboxCgroup.create(self._cgroup_parent, name, self.limits.memory_mb * 2**20,
                                        self.limits.max_processes + 2)
        except OSError as e:
            self._warn_memory_per_process(f"no cgroup under {self._cgroup_parent.path}: {e}")
            return None

    def _warn_once(self, topic: str, message: str, *args) -> None:
        """Log the warning `message` % `args` the first time `topic` comes up."""
        if topic not in self._warned:
            self._warned.add(topic)
            log.warning(message, *args)

    def _warn_memory_per_process(self, why: str) -> None:
        self._warn_once("memory", "code sandbox without a memory cgroup (%s): memory_mb bounds each process's address "
                        "space only (RLIMIT_AS), so a solution's max_processes processes can together use that many "
                        "times memory_mb; bounding their sum takes a cgroup file system with the memory controller "
                        "that the trainer may write to (as root)", why)

    def _warn_about(self, report: dict) -> None:
        """Say once what this system does not isolate."""
        if report["isolation"] == "guard":
            self._warn_once("isolation", "code sandbox without Linux namespaces (%s): solutions run with an "
                            "in-process guard only, which is not a security boundary", report.get("why"))
        elif not report.get("process_limit"):  # (the guard refuses new processes)
            self._warn_once("isolation", "code sandbox: RLIMIT_NPROC does not hold here (the machine's uid 0 through "
                            "a user namespace): a solution's processes are bounded by its time limit only")

    def _spec(self, code: str, kind: str, workdir: str, result_fd: int, cgroup: SandboxCgroup | None) -> dict:
        limits = self.limits
        return {
            "code": code, "cgroup_procs": str(cgroup.procs_file) if cgroup is not None else None, "kind": kind,
            "workdir": workdir, "result_fd": result_fd, "namespaces": self.namespaces,
            "allow_unisolated": self.allow_unisolated,
            "limits": {
                "memory_bytes": limits.memory_mb * 2**20, "file_bytes": limits.max_file_mb * 2**20,
                "processes": limits.max_processes, "disk_bytes": limits.max_disk_mb * 2**20, "files": limits.max_files,
                "cpu_seconds": math.ceil(limits.timeout_s) + 1,  # a backstop only: the wall-clock limit comes first
            },
        }

    def _start(self, files: list[Path], stdin: str | None, workdir: str, result_fd: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-I", "-c", BOOT, *map(str, files)],
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=_child_env(workdir),
            start_new_session=True, pass_fds=(result_fd,),
        )

    def _wait(self, process: subprocess.Popen, result_fd: int, stdin: str,
              began: float) -> tuple[str, str, bytes, str | None]:
        """Feed and read the child until it ends or the deadline, then kill its process group.

        Returns (stdout, stderr, the result pipe's bytes, status): status "timeout" or "output_limit", or
        None when it ended by itself.
        """
        deadline = began + self.limits.timeout_s
        try:
            stdout, stderr, result, status = _communicate(process, result_fd, stdin.encode(), deadline,
                                                          self.limits.max_output_kb * 1024)
            if status is None:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    status = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
                os.killpg(process.pid, signal.SIGKILL)  # also whatever it left behind
            process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        return stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"), bytes(result), status


@dataclass
class _Run:
    """What one sandbox gave: its streams, status and the lines its own processes wrote to the result pipe."""

    status: str | None  # "timeout" / "output_limit", or None when it ended by itself
    stdout: str
    stderr: str
    returncode: int
    seconds: float
    lines: list[dict]
    cgroup: str | None  # the memory cgroup made for it
    oom_kills: int = 0

    def _first(self, key: str) -> dict | None:
        return next((line for line in self.lines if key in line), None)

    def _said(self, key: str) -> str | None:
        line = self._first(key)
        return None if line is None else str(line[key])

    report = property(lambda self: self._first("isolation"))  # what the sandbox isolates, once it is set up
    verdict = property(lambda self: self._first("verdict"))  # of an assert test's judge
    refused = property(lambda self: self._said("refused"))  # why it would not run the solution unisolated
    setup_failed = property(lambda self: self._said("setup_failed"))


def _refusal_message(why: str) -> str:
    return (f"the code sandbox cannot isolate solutions here ({why}): allow user namespaces (Docker: "
            "--security-opt seccomp=unconfined, or run as root with CAP_SYS_ADMIN), or set "
            "rollout.code_sandbox_unisolated=true (or pass Sandbox(allow_unisolated=True)) to run model-written "
            "code with an in-process guard only, which is not a security boundary")


def _communicate(process: subprocess.Popen, result_fd: int, data: bytes, deadline: float, max_output: int):
    """Write `data` to stdin while reading stdout (at most `max_output` bytes), stderr's tail and the result
    pipe, all at once: a child blocked on a full pipe would otherwise wait for the deadline.

    Returns (stdout, stderr, result, status): status is "timeout" or "output_limit" when one of them cut the
    run short, else None (every stream closed).
    """
    out, err, result = bytearray(), bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        if process.stdin is not None:
            if data:
                os.set_blocking(process.stdin.fileno(), False)
                selector.register(process.stdin, selectors.EVENT_WRITE)
            else:
                process.stdin.close()
        selector.register(process.stdout, selectors.EVENT_READ)
        selector.register(process.stderr, selectors.EVENT_READ)
        selector.register(result_fd, selectors.EVENT_READ)
        written = 0
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return out, err, result, "timeout"
            for key, _ in selector.select(left):
                if key.fileobj is process.stdin:
                    try:
                        written += os.write(key.fd, data[written : written + READ_CHUNK])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the solution stopped reading its input
                        written = len(data)
                    if written >= len(data):
                        selector.unregister(process.stdin)
                        process.stdin.close()
                    continue
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.fileobj is process.stdout:
                    out += chunk
                    if len(out) > max_output:
                        return out[:max_output], err, result, "output_limit"
                elif key.fileobj is result_fd:
                    result += chunk[: RESULT_LIMIT - len(result)]
                else:
                    err = (err + chunk)[-STDERR_TAIL:]
    return out, err, result, None


def _test_file(assert_code: str) -> dict:
    """What the judge reads of an assert test: its code, the names it uses (`from solution import f`'s
    too) and whether it checks anything at all (an assert, a raise, or a call of an assert...() helper)."""
    try:
        nodes = list(ast.walk(ast.parse(assert_code)))
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # the judge reports it as the test's error
        nodes = []
    names = {node.id for node in nodes if isinstance(node, ast.Name)}
    names |= {alias.name for node in nodes if isinstance(node, ast.ImportFrom) for alias in node.names}
    checks = any(isinstance(node, (ast.Assert, ast.Raise)) or _called(node).startswith("assert") for node in nodes)
    return {"source": assert_code, "names": sorted(names), "checks": checks}


def _called(node: ast.AST) -> str:
    """The name a call calls (`assertEqual` of `self.assertEqual(...)`), or ""."""
    function = node.func if isinstance(node, ast.Call) else None
    if isinstance(function, ast.Attribute):
        return function.attr
    return function.id if isinstance(function, ast.Name) else ""


def _verdict(test: CodeTest, stdout: str, returncode: int) -> str:
    """A stdio test's status: its exit status, then its output against the expected one."""
    if returncode != 0:
        return "error"
    return "passed" if normalise_output(stdout) == normalise_output(test.output) else "wrong_answer"


def normalise_output(text: str) -> str:
    """Output as judges compare it: trailing spaces of each line and blank lines at either end ignored."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _lines(data: bytes) -> list[dict]:
    """The result pipe's JSON lines, each a dict (only the sandbox's own processes write there)."""
    lines = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):  # a line cut at RESULT_LIMIT (ValueError: JSONDecodeError, digit limit)
            continue
        if isinstance(value, dict):
            lines.append(value)
    return lines


def _kill_processes_of(uid: int) -> None:
    """Kill every process whose real uid is `uid`: without a PID namespace, what an unisolated solution
    left behind, found by the uid of its own it ran as (which its processes cannot change)."""
    for _ in range(10):  # a process forking meanwhile is found on the next pass
        found = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/status") as f:
                    real_uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
                if real_uid == uid:
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except (OSError, StopIteration, ValueError):  # ended meanwhile
                pass
        if not found:
            return


def _child_env(workdir: str) -> dict[str, str]:
    """A bare environment: none of the trainer's variables (tokens, keys) reach the solution."""
    single_thread = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            **single_thread}


def _remove(workdir: str) -> None:
    """Remove the working directory, even where the solution took away permissions."""

    def allow_and_retry(function, path, _):
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        function(path)

    try:
        shutil.rmtree(workdir, onerror=allow_and_retry)
    except OSError as e:  # never fail a run over a temporary folder
        log.warning("code sandbox: could not remove %s: %s", workdir, e)
