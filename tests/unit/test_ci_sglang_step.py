"""The suite skips the SGLang tests in CI (`.ci/run` runs them once, in its step for SGLang's environment): a
test marked `needs_sglang` in a file that step does not name would run nowhere."""

import ast

from tests.helpers import REPO, TESTS

# The command of .ci/run that runs RL2 inside SGLang's environment, its continued lines joined.
SGLANG_STEP = next(line for line in (REPO / ".ci" / "run").read_text().replace("\\\n", " ").splitlines()
                   if '"$SGLANG_PYTHON" -m pytest' in line)


def sglang_tests() -> dict[str, list[str]]:
    """file -> its tests marked `needs_sglang` and not slow (slow ones run with `-m slow`, on demand)."""
    found = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.parent.name == "gpu":  # the GPU check runs those, on a GPU
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                marks = " ".join(ast.unparse(decorator) for decorator in node.decorator_list)
                if "needs_sglang" in marks and "slow" not in marks:
                    found.setdefault(str(path.relative_to(REPO)), []).append(node.name)
    return found


def test_every_sglang_test_runs_in_the_sglang_step():
    found = sglang_tests()
    assert "tests/e2e/test_sglang.py" in found  # the search finds them
    missing = {file: names for file, names in found.items() if file not in SGLANG_STEP}
    assert not missing, f".ci/run's SGLang step does not run {missing}; add their files to it"
