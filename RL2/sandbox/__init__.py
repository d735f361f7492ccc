"""The code sandbox: a policy's Python code run against tests in isolated, limited processes (`runner.py`;
`child.py` is the process, `cgroup.py` its memory cgroup; docs/rewards.md). A code reward's sandbox is given
per call (`code_reward(..., sandbox=...)`) or per run (`use_sandbox`: the rollout enters the one that
`rollout.code_sandbox_unisolated` asks for), never for the whole process: two runs of one process keep their own.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from RL2.sandbox.runner import CodeLimits, CodeTest, Sandbox, SandboxError, TestResult

# What gives the run's sandbox. A task starts with a copy of its maker's context, and asyncio runs a callback
# sent from another thread in its sender's, so environment code on the environments' loop
# (`RL2.rollout.event_loop.on_env_loop`) reads the sandbox of the rollout that called it.
_run_sandbox: ContextVar[Callable[[], Sandbox]] = ContextVar("run_sandbox", default=functools.cache(Sandbox))


def run_sandbox(allow_unisolated: bool = False) -> Callable[[], Sandbox]:
    """A run's sandbox, with default limits, made at its first use (a sandbox looks for its memory cgroup when
    made, which a run without code rewards need not do)."""
    return functools.cache(functools.partial(Sandbox, allow_unisolated=allow_unisolated))


@contextlib.contextmanager
def use_sandbox(sandbox: Sandbox | Callable[[], Sandbox]) -> Iterator[None]:
    """Within, `current_sandbox()` is `sandbox` (or, for a `run_sandbox`, the one it gives)."""
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
