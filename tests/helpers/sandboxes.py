"""The code sandbox of the tests: a real one, or the test skipped where this system refuses its namespaces."""

import pytest

from RL2.sandbox import CodeLimits, CodeTest, Sandbox


def isolated_sandbox(limits: CodeLimits, skip_note: str = "") -> Sandbox:
    """A sandbox with `limits` that isolates solutions in namespaces; skips the calling test (or module fixture)
    where this system refuses them, saying so and adding `skip_note`."""
    sandbox = Sandbox(limits, max_concurrency=2)
    probe = sandbox.run_blocking("print('hi')", CodeTest(output="hi"))
    if probe.isolation != "namespaces":
        pytest.skip(f"this system refuses Linux namespaces (isolation: {probe.isolation}){skip_note}")
    return sandbox
