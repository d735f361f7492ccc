"""The code sandbox: a policy's Python code run against tests in isolated, limited processes
(`runner.py`; `child.py` is the process, `cgroup.py` its memory cgroup; docs/rewards.md)."""

from RL2.sandbox.runner import CodeLimits, CodeTest, Sandbox, SandboxError, TestResult

__all__ = ["CodeLimits", "CodeTest", "Sandbox", "SandboxError", "TestResult"]
