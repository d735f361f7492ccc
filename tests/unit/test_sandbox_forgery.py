"""Reward forgery: solutions that try to pass an assert test without working code, and ones that try
to break the sandbox's result channel. Each forgery is checked through `code_reward` or the test's
status, with an honest solution of the same test passing beside it."""

import asyncio
import logging

import pytest

from RL2.rewards import code_reward
from RL2.sandbox import CodeLimits, CodeTest, Sandbox
from tests.helpers.sandboxes import isolated_sandbox

LIMITS = CodeLimits(timeout_s=3.0, memory_mb=512, max_processes=8, max_file_mb=1, max_output_kb=64)
HONEST = "def add(a, b):\n    return a + b\n"
# `==` always true, and an object that is anything to `and`, `all()` and `bool`.
ALWAYS_EQUAL = ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
                "def add(a, b):\n    return Anything()\n")
FORGED_PASS = ('{"values": []}', '{"values": [["int", 3], ["int", 4]]}', '{"verdict": "passed"}')


def forge(lines: tuple[str, ...]) -> str:
    """A solution that writes `lines` to every file descriptor it can reach, its own and its parents'
    (/proc/PID/fd), then leaves before the test runs."""
    return f"""
import os
lines = ''.join(line + '\\n' for line in {lines!r}).encode()
targets = [str(fd) for fd in range(3, 64)]
for pid in (os.getppid(), 1):
    try:
        targets += [f'/proc/{{pid}}/fd/{{fd}}' for fd in os.listdir(f'/proc/{{pid}}/fd')]
    except OSError:
        pass
for target in targets:
    try:
        fd = int(target) if target.isdigit() else os.open(target, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, lines)
    except OSError:
        pass
os._exit(0)
"""


HUMANEVAL = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n\ncheck(add)\n"
FORMS = {
    "check(candidate)": HUMANEVAL,
    "and": "assert add(1, 2) == 3 and add(2, 2) == 4",
    "all()": "assert all(add(a, b) == a + b for a, b in [(1, 2), (2, 2)])",
    "loop": "for a, b in [(1, 2), (2, 2)]:\n    assert add(a, b) == a + b",
    "top-level": "assert add(1, 2) == 3\nassert 4 == add(2, 2)",
}


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return isolated_sandbox(LIMITS)


def reward(sandbox: Sandbox, code: str, tests: list[str]) -> float:
    return asyncio.run(code_reward(code, {"tests": [{"assert": test} for test in tests]}, sandbox=sandbox))


@pytest.mark.parametrize("form", FORMS)
def test_an_always_equal_object_passes_no_form_of_assert(sandbox, form):
    assert reward(sandbox, ALWAYS_EQUAL, [FORMS[form]]) == 0.0
    assert reward(sandbox, HONEST, [FORMS[form]]) == 1.0


def test_a_subclass_of_a_plain_type_compares_by_its_contents(sandbox):
    # Its own `==` (always true) plays no part: it crosses as the int, str or list it holds.
    code = ("class Sly(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
            "class Slyer(list):\n    def __eq__(self, other):\n        return True\n"
            "def add(a, b):\n    return Sly(0)\ndef pair(a, b):\n    return Slyer()\n")
    assert reward(sandbox, code, ["assert add(1, 2) == 3", "assert pair(1, 2) == [1, 2]"]) == 0.0


def test_a_stop_iteration_ends_no_check_early(sandbox):
    # Raised by a call inside the test's map(), it would end the map as though every item had passed.
    code = "def f(x):\n    raise StopIteration\n"
    assert reward(sandbox, code, ["assert all(map(lambda x: f(x) == x, [1, 2]))"]) == 0.0
    assert reward(sandbox, "def f(x):\n    return x\n", ["assert all(map(lambda x: f(x) == x, [1, 2]))"]) == 1.0


def test_an_object_that_contains_everything_passes_nothing(sandbox):
    code = ("class Everything:\n    def __contains__(self, item):\n        return True\n"
            "    def __bool__(self):\n        return True\n    def __len__(self):\n        return 3\n"
            "    def __iter__(self):\n        return iter([])\n"
            "def primes(n):\n    return Everything()\n")
    honest = "def primes(n):\n    return (p for p in range(2, n + 1) if all(p % d for d in range(2, p)))\n"
    for test in ("assert 3 in primes(5)\nassert 5 in primes(5)", "assert all(p in primes(5) for p in (3, 5))"):
        assert reward(sandbox, code, [test]) == 0.0, test
        assert reward(sandbox, honest, [test]) == 1.0, test


@pytest.mark.parametrize("form", FORMS)
def test_a_forged_result_line_passes_nothing(sandbox, form):
    assert reward(sandbox, forge(FORGED_PASS), [FORMS[form]]) == 0.0


def test_a_forged_setup_failure_fails_the_test_only(sandbox):
    code = forge(('{"setup_failed": "forged"}',))
    for test in (CodeTest(assert_code="assert add(1, 2) == 3"), CodeTest(output="1")):
        result = sandbox.run_blocking(code, test)  # no SandboxError out of the reward
        assert result.status in ("error", "wrong_answer") and result.isolation == "namespaces", result


def test_the_expected_values_are_not_in_the_solutions_reach(sandbox):
    # Every constant of every code object on the solution's stack (the test's, compiled, in the old design).
    code = ("import sys\nseen = set()\nframe = sys._getframe()\n"
            "def walk(value, depth=0):\n"
            "    if depth > 4:\n        return\n"
            "    if hasattr(value, 'co_consts'):\n"
            "        for const in value.co_consts:\n"
            "            seen.add(repr(const))\n            walk(const, depth + 1)\n"
            "    elif isinstance(value, (list, tuple)):\n"
            "        for item in value:\n            walk(item, depth + 1)\n"
            "    elif isinstance(value, dict):\n"
            "        for item in value.values():\n            walk(item, depth + 1)\n"
            "while frame is not None:\n    walk(frame.f_locals)\n    walk(frame.f_code)\n    frame = frame.f_back\n"
            "print('31337' in seen)\n"
            "def add(a, b):\n    return a + b\n")
    result = sandbox.run_blocking(code, CodeTest(assert_code="for a in [1]:\n    assert add(a, 31336) == 31337"))
    assert result.passed and result.stdout.split() == ["False"], result


def test_a_test_that_checks_nothing_is_not_passed(sandbox, caplog):
    with caplog.at_level(logging.WARNING, logger="RL2.sandbox.runner"):
        for test in ("add(1, 2)", "assert True", "x = 1\nassert x == 1"):
            result = sandbox.run_blocking(HONEST, CodeTest(assert_code=test))
            assert result.status == "error" and "checks nothing" in result.stderr, (test, result)
    assert len([r for r in caplog.records if "checks nothing" in r.getMessage()]) == 1  # said once


def test_values_larger_than_a_pipe_do_not_stall(sandbox):
    code = "def numbers(n):\n    return list(range(n))\n"
    result = sandbox.run_blocking(code, CodeTest(assert_code="assert numbers(30000) == list(range(30000))"))
    assert result.passed and result.seconds < 2, result


def test_a_forged_huge_integer_fails_the_test_only(sandbox):
    # Past Python's int-to-str digit limit (4300 digits), where json.loads raises ValueError.
    huge = "1" * 5000
    code = forge((f'{{"values": [["int", {huge}]]}}', f'{{"verdict": {huge}}}'))
    result = sandbox.run_blocking(code, CodeTest(assert_code="assert add(1, 2) == 3"))
    assert result.status == "error", result


def test_huge_integers_cross_as_values(sandbox):
    code = "def power(n):\n    return 7 ** n\n"
    assert sandbox.run_blocking(code, CodeTest(assert_code="assert power(20000) == 7 ** 20000")).passed


# ---- honest tests of every shape still pass ----

SHAPES = [
    ("class Solution:\n    def twoSum(self, nums, target):\n"
     "        seen = {}\n        for i, n in enumerate(nums):\n"
     "            if target - n in seen:\n                return [seen[target - n], i]\n            seen[n] = i\n",
     "assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]\ns = Solution()\nassert s.twoSum([3, 3], 6) == [0, 1]"),
    ("import math\ndef area(r):\n    return math.pi * r * r\n", "assert math.isclose(area(2), 12.566, rel_tol=1e-3)"),
    ("def gen(n):\n    yield from range(n)\n", "assert list(gen(3)) == [0, 1, 2]\nassert sum(gen(4)) == 6"),
    ("def div(a, b):\n    if b == 0:\n        raise ValueError('b is 0')\n    return a / b\n",
     "try:\n    div(1, 0)\n    raise AssertionError('no error')\nexcept ValueError:\n    pass\n"
     "assert div(1, 4) == 0.25"),
    ("def f():\n    return (1, 'a', None, {'k': {2, 3}}, b'x', 1.5, True)\n",
     "assert f() == (1, 'a', None, {'k': {2, 3}}, b'x', 1.5, True)\n"
     "assert f() != [1, 'a', None, {'k': {2, 3}}, b'x', 1.5, True]"),
    ("class Node:\n    def __init__(self, val, nxt=None):\n        self.val, self.nxt = val, nxt\n"
     "def build(values):\n    head = None\n    for v in reversed(values):\n        head = Node(v, head)\n"
     "    return head\n"
     "def total(node):\n    return 0 if node is None else node.val + total(node.nxt)\n",
     "head = build([1, 2, 3])\nassert head.val == 1 and head.nxt.val == 2\nassert total(head) == 6"),
    ("TABLE = list(range(10**6))\ndef at(i):\n    return TABLE[i]\n", "from solution import at\nassert at(5) == 5"),
    ("from collections import Counter, namedtuple\nPoint = namedtuple('Point', 'x y')\n"
     "def count(text):\n    return Counter(text)\ndef origin():\n    return Point(0, 0)\n",
     "assert count('aab') == {'a': 2, 'b': 1}\nassert origin() == (0, 0)"),
    ("LIMIT = 10\ndef sort_in_place(items):\n    items.sort()\n",
     "x = [3, 1, 2]\nsort_in_place(x)\nassert x == [1, 2, 3]\n"
     "assert LIMIT == 10"),
]


@pytest.mark.parametrize("code, test", SHAPES)
def test_honest_solutions_of_every_shape_pass(sandbox, code, test):
    result = sandbox.run_blocking(code, CodeTest(assert_code=test))
    assert result.passed, result
    assert not sandbox.run_blocking(ALWAYS_EQUAL, CodeTest(assert_code=test)).passed
