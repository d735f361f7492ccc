"""Training on a plain reward function (`rollout.reward_fn`), wrapped as a one-turn environment whose `step`
scores the response and ends the trajectory. See docs/rewards.md.
"""

import inspect
from collections.abc import Callable

from RL2.rewards.composite import call_reward, reward_step
from RL2.rollout.env import Env, EnvError
from RL2.utils.imports import import_file_or_module


def reward_env(function: Callable, name: str = "reward function") -> Env:
    """An environment whose single `step` scores the action with `function(action, extra_info) -> float | dict`
    (sync or async); errors call it `name`."""

    async def step(state: str, action: str, extra_info: dict) -> dict:
        return reward_step(await call_reward(function, action, extra_info), extra_info)

    return Env(path=name, step_fn=step)


def load_reward_fn(spec: str) -> Callable:
    """The function named by `path/to/file.py:name` or `package.module:name` (name: default `reward`)."""
    where, name = spec.rsplit(":", 1) if ":" in spec else (spec, "reward")
    name = name or "reward"
    try:
        module = import_file_or_module(where, "rl2_reward_")
    except FileNotFoundError as e:
        raise EnvError(f"rollout.reward_fn: {e}; give 'path/to/file.py:function_name'") from None
    except ImportError as e:
        raise EnvError(f"rollout.reward_fn: cannot import module '{where}' ({e}); give "
                       f"'path/to/file.py:function_name' or 'package.module:function_name'") from e
    function = getattr(module, name, None)
    if not callable(function):
        raise EnvError(f"rollout.reward_fn: {where} has no function '{name}'")
    check_reward_signature(function, f"rollout.reward_fn: {where}:{name}")
    return function


def check_reward_signature(function: Callable, what: str) -> None:
    """Fail at start, not on every response, when `function` cannot take (response, extra_info), naming it `what`."""
    try:
        inspect.signature(function).bind("response", {})
    except ValueError:  # no signature to check (some builtins)
        pass
    except TypeError as e:
        raise EnvError(f"{what} must accept (response: str, extra_info: dict): {e}") from e


def load_reward_env(spec: str) -> Env:
    """`reward_env` of the function named by `spec` (see `load_reward_fn`)."""
    return reward_env(load_reward_fn(spec), name=spec)
