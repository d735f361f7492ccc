"""What the env scripts of RL2's original releases (`envs/*.py` of 0.0.1.post1 and 0.0.2) expect beyond RL2's
protocol (`RL2.rollout.env`), so that they run unchanged; each is listed in docs/compatibility.md."""

import functools
import inspect
import itertools
import sys
import threading
import types
from collections.abc import Callable


def adapt_script(step: Callable, reset: Callable | None) -> tuple[Callable, Callable | None]:
    """A script's `step` and `reset` (None: it has none) as RL2 calls them, made once per `Env`: a row without
    `extra_info["idx"]` gets a number (the original's gem.py picks a pooled environment by it), a `reset` result
    `(state, extra_info)` gives the trajectory that extra_info, a NumPy bool `done` becomes a bool."""
    numbers = itertools.count()

    def number(extra_info: dict) -> None:
        if "idx" not in extra_info:
            extra_info["idx"] = next(numbers)

    async def adapted_step(state, action, extra_info: dict):
        number(extra_info)
        result = await step(state, action, extra_info)
        done = result.get("done") if isinstance(result, dict) else None
        if hasattr(done, "item") and isinstance(done.item(), bool):
            result = {**result, "done": done.item()}
        return result

    async def adapted_reset(extra_info: dict):
        number(extra_info)
        state = await reset(extra_info)
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state, new_info = state
            if new_info is not extra_info:  # the trajectory holds `extra_info`: update it in place
                extra_info.clear()
                extra_info.update(new_info)
        return state

    for fn in (step, reset):
        math_verify_off_the_main_thread(getattr(fn, "__globals__", {}))  # the names the script's code looks up
    return adapted_step, None if reset is None else adapted_reset


def math_verify_off_the_main_thread(namespace: dict) -> None:
    """Rebind a script module's names for math-verify's `parse` and `verify` (the original's orz.py), or for the
    package, to ones without timeouts off the main thread: math-verify's use SIGALRM, which only the main thread
    may, and environment code runs on a thread of its own, bounded by rollout.env_timeout instead. math-verify
    itself, as any other code sees it, stays as it is."""
    math_verify = sys.modules.get("math_verify")
    if math_verify is None:  # the script did not import it
        return
    parse = _untimed_off_the_main_thread(math_verify.parse, "parsing_timeout")
    verify = _untimed_off_the_main_thread(math_verify.verify, "timeout_seconds")
    for name, value in list(namespace.items()):
        if value is math_verify:  # `import math_verify`: a copy of the package, with the two functions
            namespace[name] = types.ModuleType(value.__name__)
            vars(namespace[name]).update(vars(value), parse=parse, verify=verify)
        elif value is math_verify.parse:
            namespace[name] = parse
        elif value is math_verify.verify:
            namespace[name] = verify


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
