"""Code rewards: the response's Python solution run against the row's tests in a sandbox (`{"input", "output"}`,
`{"assert"}` or APPS/verl's `{"inputs", "outputs"}` tests: docs/rewards.md)."""

import json

from RL2.rewards.extract import extract_code
from RL2.sandbox import CodeTest, Sandbox, current_sandbox


async def code_reward(response: str, extra_info: dict, *, all_or_nothing: bool = False, tests_key: str = "tests",
                      sandbox: Sandbox | None = None) -> float:
    """The fraction of the tests at `extra_info[tests_key]` that the response's code (its last ```python fence,
    else the whole text) passes; with `all_or_nothing`, 1.0 only when every test passes (stopping at the
    first failure), else 0.0. `sandbox`: limits and concurrency (default: the run's, `current_sandbox()`)."""
    tests = parse_tests(extra_info.get(tests_key), tests_key)
    sandbox = sandbox or current_sandbox()
    results = await sandbox.run_tests(extract_code(response), tests, stop_at_failure=all_or_nothing)
    passed = sum(result.passed for result in results)
    if all_or_nothing:
        return float(passed == len(tests))
    return passed / len(tests)


def parse_tests(value: object, key: str = "tests") -> list[CodeTest]:
    """The tests of a row, checked: `value` is a list of {"input", "output"} / {"assert"} dicts, a dict
    {"inputs": [...], "outputs": [...]}, or either as a JSON string, from extra_info[`key`]."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"extra_info['{key}'] is a string but not JSON: {e}") from e
    if isinstance(value, dict) and "inputs" in value:
        if "fn_name" in value:
            raise ValueError(f"extra_info['{key}'] has fn_name (call-based tests): write them as "
                             f"{{'assert': 'assert f(...) == ...'}} tests instead")
        inputs, outputs = value["inputs"], value.get("outputs")
        if not isinstance(outputs, list) or len(outputs) != len(inputs):
            raise ValueError(f"extra_info['{key}'] needs as many 'outputs' as 'inputs'")
        value = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if not isinstance(value, list) or not value:
        raise ValueError(f"extra_info['{key}'] should be a non-empty list of tests "
                         f"({{'input': ..., 'output': ...}} or {{'assert': ...}}), got {type(value).__name__}")
    return [_parse_test(test, key, i) for i, test in enumerate(value)]


def _parse_test(test: object, key: str, index: int) -> CodeTest:
    where = f"extra_info['{key}'][{index}]"
    if isinstance(test, dict) and isinstance(test.get("assert"), str):
        return CodeTest(assert_code=test["assert"])
    if isinstance(test, dict) and isinstance(test.get("output"), str) and isinstance(test.get("input", ""), str):
        return CodeTest(input=test.get("input", ""), output=test["output"])
    raise ValueError(f"{where} should be {{'input': str, 'output': str}} or {{'assert': str}}, got {test!r:.100}")
