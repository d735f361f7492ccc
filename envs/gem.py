"""Any GEM environment (github.com/axon-rl/gem), e.g. `rg:letter_counting`, `game:Sudoku-v0-easy`.

extra_info: `env_id` (default: the RL2_GEM_ENV variable) and `seed`, which picks the problem (give
the responses of one prompt the same seed). The conversation is kept as chat messages, so a
multi-turn game continues one sequence. Needs GEM: pip install 'RL2[gem]'.
"""

import asyncio
import os
import threading

# GEM draws its problems (and some games their moves, e.g. 2048's new tiles) from the global `random` and
# `numpy.random`, seeded by `reset(seed)`. Trajectories run GEM calls in threads at once: another thread's
# seeding or draws in the middle of a reset would change the problem its seed picks. One call at a time.
GEM_LOCK = threading.Lock()


async def call(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` in a thread (GEM is synchronous), while no other GEM call runs."""

    def locked():
        with GEM_LOCK:
            return fn(*args, **kwargs)

    return await asyncio.to_thread(locked)


def make(env_id: str, seed: int):
    try:
        import gem
    except ImportError as e:
        raise ImportError("envs/gem.py needs GEM: pip install 'RL2[gem]' (or pip install gem-llm)") from e
    try:
        return gem.make(env_id, seed=seed)
    except Exception as e:  # ids backed by a dataset fail in many ways when it cannot be loaded
        raise RuntimeError(
            f"GEM env {env_id!r} could not be created ({type(e).__name__}: {e}). Ids backed by a dataset "
            f"(qa:*, math:*, ...) download it from the Hugging Face hub and may need extra packages: prepare "
            f"them where the hub is reachable, or use a generated env such as rg:letter_counting"
        ) from e


def user_message(observation: str, info: dict) -> dict:
    # GEM games give the current board in info["suffix"]; GEM's ObservationWrapper appends it too.
    return {"role": "user", "content": observation + info.get("suffix", "")}


async def reset(extra_info: dict) -> list[dict]:
    env_id = extra_info.get("env_id") or os.environ.get("RL2_GEM_ENV")
    if not env_id or "seed" not in extra_info:
        raise ValueError("envs/gem.py needs extra_info['seed'] and an env id (extra_info['env_id'] or RL2_GEM_ENV)")
    # GEM is synchronous: threads keep its work off the event loop that runs the other trajectories.
    env = await call(make, env_id, extra_info["seed"])
    observation, info = await call(env.reset, seed=extra_info["seed"])
    # Every trajectory has its own copy of extra_info: it holds this trajectory's env and conversation.
    extra_info["env_id"], extra_info["gem_env"], extra_info["messages"] = env_id, env, [user_message(observation, info)]
    return extra_info["messages"]


def replay(extra_info: dict):
    """The env of a trajectory restored from a checkpoint, which keeps the conversation but not the env
    (`Trajectory.to_dict`): made, reset and stepped through the actions again (the same game where
    GEM's steps draw no random numbers)."""
    env = make(extra_info["env_id"], extra_info["seed"])
    env.reset(seed=extra_info["seed"])
    for message in extra_info["messages"]:
        if message["role"] == "assistant":
            env.step(message["content"])
    return env


async def step(state: str, action: str, extra_info: dict) -> dict:
    if extra_info.get("gem_env") is None:
        extra_info["gem_env"] = await call(replay, extra_info)
    observation, reward, terminated, truncated, info = await call(extra_info["gem_env"].step, action)
    turn = [{"role": "assistant", "content": action}, user_message(observation, info)]
    extra_info["messages"] = extra_info["messages"] + turn  # a new list: earlier states stay as they were
    reward, done = float(reward), bool(terminated or truncated)
    return {"next_state": extra_info["messages"], "reward": reward, "score": reward, "done": done,
            "extra_info": extra_info}
