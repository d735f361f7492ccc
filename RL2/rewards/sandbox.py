"""Run a policy's Python code against one test in a separate, isolated, limited process.

Each test runs in a fresh process (`sandbox_child.py`, which describes the isolation, and
docs/rewards.md): namespaces, a read-only file system but for a temporary working directory,
resource limits, no capabilities, none of the trainer's variables and, where the machine allows it
(`sandbox_cgroup.py`), a memory cgroup of its own. The wall-clock limit is enforced from here: on
timeout the process group is killed, and with it the PID namespace (every process the solution
started, even one that left the group).

The waiting happens in a thread pool of `max_concurrency` threads, so an event loop stays free
(`await sandbox.run(...)`) and at most that many solutions run at once. A solution that hangs,
crashes, floods its output or exhausts its limits fails its test; only a sandbox that cannot start
at all raises `SandboxError`.
"""

import ast
import asyncio
import contextlib
import json
import logging
import math
import operator
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from RL2.rewards.sandbox_cgroup import DEFAULT_ROOT, SandboxCgroup, find_parent

CHILD = Path(__file__).with_name("sandbox_child.py")
STDERR_TAIL = 4096
READ_CHUNK = 65536

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
    "__main__":` block is skipped) and the test passes when the assert code runs to its end.
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
        cgroup_root: where the cgroup file systems are mounted (`sandbox_cgroup.py`); where no
            cgroup can be made, or with None, memory is bounded per process only (said once).
    """

    def __init__(self, limits: CodeLimits | None = None, max_concurrency: int | None = None, namespaces: bool = True,
                 allow_unisolated: bool = False, cgroup_root: str | None = DEFAULT_ROOT):
        self.limits = limits or CodeLimits()
        self.namespaces = namespaces
        self.allow_unisolated = allow_unisolated
        self.max_concurrency = max_concurrency or default_concurrency()
        self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rl2-sandbox")
        self._warned = False
        self._memory_warned = False
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
        workdir = tempfile.mkdtemp(prefix="rl2-sandbox-")
        read_end, write_end = os.pipe()  # the child's report, and the assert test's values
        steps, checks = assert_plan(test.assert_code) if test.assert_code is not None else ([], [])
        cgroup = self._new_cgroup(Path(workdir).name)
        oom_kills = 0
        try:
            try:
                spec_path = Path(workdir) / ".spec.json"
                spec_path.write_text(json.dumps(self._spec(code, test, workdir, write_end, steps, cgroup)))
                began = time.monotonic()
                process = self._start(spec_path, test, workdir, write_end)
            finally:
                os.close(write_end)  # the child has its copy
            stdout, stderr, status = self._wait(process, test, began)
            seconds = time.monotonic() - began
            report, values = _read_report(read_end)
        finally:
            os.close(read_end)
            if cgroup is not None:
                oom_kills = cgroup.remove()  # with whatever the solution left behind
            _remove(workdir)
        if report is None or "setup_failed" in report:
            if status is None:  # not cut short by a limit: it ended before the solution could start
                why = report["setup_failed"] if report else f"status {process.returncode}: {stderr.strip()[-500:]}"
                raise SandboxError(f"the code sandbox could not start the solution ({why})")
            report = None
        if report and report["isolation"] == "guard" and not self.allow_unisolated:
            raise SandboxError(f"the code sandbox cannot isolate solutions here ({report.get('why')}): allow user "
                               "namespaces (Docker: --security-opt seccomp=unconfined, or run as root with "
                               "CAP_SYS_ADMIN), or set rollout.code_sandbox_unisolated=true (or pass "
                               "Sandbox(allow_unisolated=True)) to run model-written code with an in-process guard "
                               "only, which is not a security boundary")
        if report and not self._warned:
            self._warn_about(report)
        if report and cgroup is not None and not report.get("memory_cgroup"):
            self._warn_memory_per_process(f"the sandbox could not join {cgroup.path}")
        if status is None:
            failed = _failed_check(checks, values) if values is not None else None
            status = _verdict(test, stdout, process.returncode, values is not None and failed is None)
            if failed and status == "error":
                stderr += f"AssertionError: {failed}\n"
        if oom_kills:
            stderr += (f"sandbox: out of memory: its processes together reached memory_mb ({self.limits.memory_mb} "
                       f"MB) and the kernel killed {oom_kills} of them\n")
        memory_scope = ("sandbox" if report.get("memory_cgroup") else "process") if report else "unknown"
        return TestResult(status, seconds, stdout, stderr, report["isolation"] if report else "unknown", memory_scope)

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

    def _warn_memory_per_process(self, why: str) -> None:
        """Say once that memory is bounded per process only."""
        if not self._memory_warned:
            self._memory_warned = True
            log.warning("code sandbox without a memory cgroup (%s): memory_mb bounds each process's address space "
                        "only (RLIMIT_AS), so a solution's max_processes processes can together use that many times "
                        "memory_mb; bounding their sum takes a cgroup file system with the memory controller that "
                        "the trainer may write to (as root)", why)

    def _warn_about(self, report: dict) -> None:
        """Say once what this system does not isolate."""
        if report["isolation"] == "guard":
            self._warned = True
            log.warning("code sandbox without Linux namespaces (%s): solutions run with an in-process guard only, "
                        "which is not a security boundary", report.get("why"))
        elif not report.get("process_limit"):  # (the guard refuses new processes)
            self._warned = True
            log.warning("code sandbox: RLIMIT_NPROC does not hold here (the machine's uid 0 through a user "
                        "namespace): a solution's processes are bounded by its time limit only")

    def _spec(self, code: str, test: CodeTest, workdir: str, result_fd: int, steps: list,
              cgroup: SandboxCgroup | None) -> dict:
        limits = self.limits
        return {
            "code": code,
            "cgroup_procs": str(cgroup.procs_file) if cgroup is not None else None,
            "kind": "assert" if test.assert_code is not None else "stdio",
            "steps": steps,
            "workdir": workdir,
            "result_fd": result_fd,
            "namespaces": self.namespaces,
            "limits": {
                "memory_bytes": limits.memory_mb * 2**20,
                "file_bytes": limits.max_file_mb * 2**20,
                "processes": limits.max_processes,
                "disk_bytes": limits.max_disk_mb * 2**20,
                "files": limits.max_files,
                # A backstop only: the wall-clock limit below comes first.
                "cpu_seconds": math.ceil(limits.timeout_s) + 1,
            },
        }

    def _start(self, spec_path: Path, test: CodeTest, workdir: str, result_fd: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-I", str(CHILD), str(spec_path)],
            stdin=subprocess.PIPE if test.assert_code is None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=_child_env(workdir),
            start_new_session=True, pass_fds=(result_fd,),
        )

    def _wait(self, process: subprocess.Popen, test: CodeTest, began: float) -> tuple[str, str, str | None]:
        """Feed and read the child until it ends or the deadline, then kill its process group.

        Returns (stdout, stderr, status): status "timeout" or "output_limit", or None when it ended by itself.
        """
        deadline = began + self.limits.timeout_s
        try:
            stdout, stderr, status = _communicate(process, test.input.encode(), deadline, self.limits.max_output_kb * 1024)
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
        return stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"), status


def _communicate(process: subprocess.Popen, data: bytes, deadline: float, max_output: int):
    """Write `data` to stdin while reading stdout (at most `max_output` bytes) and stderr's tail.

    Returns (stdout, stderr, status): status is "timeout" or "output_limit" when one of them cut the
    run short, else None (both streams closed).
    """
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        if process.stdin is not None:
            if data:
                os.set_blocking(process.stdin.fileno(), False)
                selector.register(process.stdin, selectors.EVENT_WRITE)
            else:
                process.stdin.close()
        selector.register(process.stdout, selectors.EVENT_READ)
        selector.register(process.stderr, selectors.EVENT_READ)
        written = 0
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return out, err, "timeout"
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
                        return out[:max_output], err, "output_limit"
                else:
                    err = (err + chunk)[-STDERR_TAIL:]
    return out, err, None


def _verdict(test: CodeTest, stdout: str, returncode: int, asserts_hold: bool) -> str:
    if returncode != 0 or (test.assert_code is not None and not asserts_hold):
        return "error"
    if test.assert_code is not None:
        return "passed"
    return "passed" if normalise_output(stdout) == normalise_output(test.output) else "wrong_answer"


COMPARISONS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
               ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
               ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}


def assert_plan(assert_code: str) -> tuple[list, list]:
    """Split an assert test into the child's steps and the checks made here on the values it returns.

    Each top-level `assert` becomes expressions for the child to evaluate: both sides of a comparison
    (a literal side such as `3` or `[1, 2]` stays here, unseen by the solution) or the whole test.
    Other statements run in the child as they are, asserts nested in them (a loop's) included.

    Returns (steps, checks): steps are ("exec", source) or ("eval", source); a check is
    ("compare", ops, operands), each operand ("value", index in the child's values) or ("literal",
    value), or ("true", index).
    """
    try:
        module = ast.parse(assert_code)
    except SyntaxError:  # the child reports it as the test's error
        return [("exec", assert_code)], []
    steps, checks = [], []

    def evaluated(node: ast.expr) -> tuple:
        try:
            return ("literal", ast.literal_eval(node))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            steps.append(("eval", ast.unparse(node)))
            return ("value", sum(kind == "eval" for kind, _ in steps) - 1)

    for statement in module.body:
        if not isinstance(statement, ast.Assert):
            steps.append(("exec", ast.unparse(statement)))
        elif isinstance(statement.test, ast.Compare):
            compare = statement.test
            operands = [evaluated(node) for node in (compare.left, *compare.comparators)]
            checks.append(("compare", [type(op) for op in compare.ops], operands, ast.unparse(statement)))
        else:
            checks.append(("true", evaluated(statement.test), ast.unparse(statement)))
    return steps, checks


def _failed_check(checks: list, values: list) -> str | None:
    """The first assert that does not hold on the child's values (rebuilt from their serialised
    form), or None when all hold."""
    try:
        rebuilt = [_rebuild(value) for value in values]

        def operand(item: tuple):
            kind, value = item
            return rebuilt[value] if kind == "value" else value

        for check in checks:
            source = check[-1]
            if check[0] == "true":
                holds = bool(operand(check[1]))
            else:
                sides = [operand(item) for item in check[2]]
                holds = all(COMPARISONS[op](a, b) for op, a, b in zip(check[1], sides, sides[1:]))
            if not holds:
                return source
        return None
    except Exception as e:  # values the solution wrote itself, malformed, or that do not compare
        return f"the test's values could not be compared ({type(e).__name__}: {e})"


def _rebuild(node: list):
    """A value from `sandbox_child.plain`'s tagged JSON: built-in types only."""
    kind, payload = node
    if kind in ("NoneType", "bool", "int", "float", "str"):
        if type(payload).__name__ != kind and not (kind == "float" and type(payload) is int):
            raise ValueError(f"a {kind} tagged value holds a {type(payload).__name__}")
        return float(payload) if kind == "float" else payload
    if kind == "bytes":
        return bytes.fromhex(payload)
    if kind == "dict":
        return {_rebuild(k): _rebuild(v) for k, v in payload}
    container = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind]
    return container(_rebuild(item) for item in payload)


def normalise_output(text: str) -> str:
    """Output as judges compare it: trailing spaces of each line and blank lines at either end ignored."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _read_report(read_end: int) -> tuple[dict | None, list | None]:
    """The child's report and, for an assert test, the values it evaluated.

    The report is the first line: the isolation in effect, or {"setup_failed": why}; a later report
    line can only be a failure to start the solution (written before anything of it runs). The values
    are the last {"values": [...]} line (a solution can write such a line too, but only with values
    it computed: the expected ones never leave this process).
    """
    os.set_blocking(read_end, False)
    data = b""
    while True:
        try:
            chunk = os.read(read_end, READ_CHUNK)
        except BlockingIOError:  # a leftover process still holds the pipe: what is there is enough
            break
        if not chunk:
            break
        data += chunk
    lines = [_json_dict(line) for line in data.decode("utf-8", "replace").splitlines()]
    report = lines[0] if lines else None
    if len(lines) > 1 and lines[1] and "setup_failed" in lines[1]:
        report = lines[1]
    values = [line["values"] for line in lines[1:] if line and isinstance(line.get("values"), list)]
    return report, values[-1] if values else None


def _json_dict(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, RecursionError):  # whatever the solution wrote
        return None
    return value if isinstance(value, dict) else None


def _child_env(workdir: str) -> dict[str, str]:
    """A bare environment: none of the trainer's variables (tokens, keys) reach the solution."""
    single_thread = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", **single_thread}


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
