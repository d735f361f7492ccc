"""The env scripts of RL2's original releases (`envs/*.py` of 0.0.1.post1 and 0.0.2) run unchanged: what they
expect beyond RL2's protocol (`RL2.rollout.env`), each listed in docs/compatibility.md, is adapted once per
`Env`, by `adapt_script`:

- a numbered `extra_info["idx"]`: the original numbered every row; its gem.py picks a pooled environment by it;
- a `reset` that returns `(state, extra_info)` (0.0.2's gem.py);
- a NumPy bool `done` (GEM's `terminated or truncated`);
- math-verify's `parse` and `verify` with their default timeouts (0.0.x orz.py), off the main thread.
"""

import functools
import inspect
import itertools
import sys
import threading
import types
from collections.abc import Callable


def adapt_script(step: Callable, reset: Callable | None) -> tuple[Callable, Callable | None]:
    """The `step` and `reset` (None: the script has none) of an env script as RL2 calls them: each call numbers
    `extra_info["idx"]` when the row has none, a `reset` result `(state, extra_info)` gives the trajectory that
    extra_info, and a NumPy bool `done` becomes a bool. The results of RL2's own protocol pass unchanged, so
    every script is adapted, as every script has always been numbered. The scripts' own names for math-verify's
    functions are rebound once (`math_verify_off_the_main_thread`)."""
    numbers = itertools.count()

    def number(extra_info: dict) -> None:
        if "idx" not in extra_info:
            extra_info["idx"] = next(numbers)

    async def numbered_step(state, action, extra_info: dict):
        number(extra_info)
        return _bool_done(await step(state, action, extra_info))

    async def numbered_reset(extra_info: dict):
        number(extra_info)
        return _reset_state(await reset(extra_info), extra_info)

    for fn in (step, reset):
        math_verify_off_the_main_thread(getattr(fn, "__globals__", {}))  # the names the script's code looks up
    return numbered_step, None if reset is None else numbered_reset


def _reset_state(result: object, extra_info: dict) -> object:
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        result, new_info = result
        if new_info is not extra_info:  # the trajectory holds `extra_info`: update it in place
            extra_info.clear()
            extra_info.update(new_info)
    return result


def _bool_done(result: object) -> object:
    done = result.get("done") if isinstance(result, dict) else None
    if hasattr(done, "item") and isinstance(done.item(), bool):
        result = {**result, "done": done.item()}
    return result


def math_verify_off_the_main_thread(namespace: dict) -> None:
    """Rebind the names of a script's module (`namespace`) for math-verify's `parse` and `verify`, or for the
    `math_verify` package, to ones that run without math-verify's timeouts off the main thread.

    math-verify bounds its time with SIGALRM, which Python allows only in the main thread, and raises in any
    other unless called with timeout None. Environment code runs on a thread of its own, where
    rollout.env_timeout bounds a step instead; scripts written for the main thread (the original RL2's
    envs/orz.py: `from math_verify import parse, verify`) call them with the defaults. Only the script's own
    names change: math-verify, as any other code sees it, stays as it is.
    """
    math_verify = sys.modules.get("math_verify")
    if math_verify is None:  # the script did not import it
        return
    thread_aware = {"parse": _untimed_off_the_main_thread(math_verify.parse, "parsing_timeout"),
                    "verify": _untimed_off_the_main_thread(math_verify.verify, "timeout_seconds")}
    for name, value in list(namespace.items()):
        if value is math_verify:  # `import math_verify`: a copy of the package with the two functions
            namespace[name] = types.ModuleType(math_verify.__name__, math_verify.__doc__)
            vars(namespace[name]).update({**vars(math_verify), **thread_aware})
        for function in ("parse", "verify"):
            if value is getattr(math_verify, function):
                namespace[name] = thread_aware[function]


def _untimed_off_the_main_thread(fn: Callable, timeout: str) -> Callable:
    """`fn`, called with its argument `timeout` None in any thread but the main one."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            bound = signature.bind(*args, **kwargs)
            bound.arguments[timeout] = None
            args, kwargs = bound.args, bound.kwargs
        return fn(*args, **kwargs)

    return call
