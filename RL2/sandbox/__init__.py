"""The code sandbox: a policy's Python code run against tests in isolated, limited processes
(`runner.py`; `child.py` is the process, `cgroup.py` its memory cgroup; docs/rewards.md).

Whichever sandbox a run's code rewards use is set per call (`code_reward(..., sandbox=...)`) or per run
(`use_sandbox`, which the rollout enters with the sandbox `rollout.code_sandbox_unisolated` asks for),
never for the whole process: two runs of one process keep their own.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from RL2.sandbox.runner import CodeLimits, CodeTest, Sandbox, SandboxError, TestResult

# A function giving the run's sandbox. A task starts with a copy of its maker's context, and asyncio hands a
# callback from another thread the context of its sender, so environment code on the environments' loop
# (`RL2.rollout.event_loop.on_env_loop`) reads the sandbox of the rollout that called it.
_run_sandbox: ContextVar[Callable[[], Sandbox]] = ContextVar("run_sandbox", default=functools.cache(Sandbox))


def run_sandbox(allow_unisolated: bool = False) -> Callable[[], Sandbox]:
    """A run's sandbox, with default limits, made at its first use (a run without code rewards makes none:
    a sandbox looks for its memory cgroup when made)."""
    return functools.cache(functools.partial(Sandbox, allow_unisolated=allow_unisolated))


@contextlib.contextmanager
def use_sandbox(sandbox: Sandbox | Callable[[], Sandbox]) -> Iterator[None]:
    """Within, `current_sandbox()` is `sandbox` (or what it gives, for `run_sandbox`'s)."""
    token = _run_sandbox.set((lambda: sandbox) if isinstance(sandbox, Sandbox) else sandbox)
    try:
        yield
    finally:
        _run_sandbox.reset(token)


def current_sandbox() -> Sandbox:
    """The sandbox code rewards use unless given one: the run's (`use_sandbox`), else one with default limits,
    made at its first use and shared by the process."""
    return _run_sandbox.get()()


__all__ = ["CodeLimits", "CodeTest", "Sandbox", "SandboxError", "TestResult", "current_sandbox", "run_sandbox",
           "use_sandbox"]
