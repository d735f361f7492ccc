"""The event loops of a rank's rollouts, each kept for the whole run.

Every rollout, evaluation and partial-rollout round of a process runs on one loop (`run_on_rank_loop`), so
what an agent or the engine makes in its first rollout (an HTTP client session, the OpenAI endpoint's server)
still works in the next one; a new loop per rollout (`asyncio.run`) would leave such objects bound to a
closed loop. Environment code (`step`, `reset`, tools) runs on a second loop in a thread of its own
(`on_env_loop`), also kept for the whole run: module-level asyncio objects of a script work across
rollouts, and blocking code in an async step stops only that loop, so the engine goes on sampling and
the step's timeout still fires.
"""

import asyncio
import atexit
import threading
from collections.abc import Coroutine

_loop: asyncio.AbstractEventLoop | None = None
_env_loop: asyncio.AbstractEventLoop | None = None


class Escaped(Exception):
    """What environment code raised that is not an `Exception` (`sys.exit()`, `KeyboardInterrupt`): it ends
    one trajectory, as an exception of the script does, instead of the trainer."""


def run_on_rank_loop(coroutine: Coroutine):
    """Run `coroutine` to its end on the rank's loop (from outside any running loop), which is made at the
    first call and closed at exit."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
        atexit.register(close_rank_loop)
    return _loop.run_until_complete(coroutine)


def close_rank_loop() -> None:
    """Cancel what still waits on the loop (an engine's idle scheduler, a server), then close it."""
    global _loop
    loop, _loop = _loop, None
    if loop is None or loop.is_closed():
        return
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def env_loop() -> asyncio.AbstractEventLoop:
    """The environments' loop, running in a daemon thread of its own; made at the first call."""
    global _env_loop
    if _env_loop is None or _env_loop.is_closed():
        _env_loop = asyncio.new_event_loop()
        threading.Thread(target=_env_loop.run_forever, name="rl2-env-loop", daemon=True).start()
    return _env_loop


async def on_env_loop(coroutine: Coroutine):
    """Await `coroutine` run on the environments' loop. What it raises is raised here; a `BaseException`
    that is not an `Exception` (other than cancellation) as `Escaped`. Cancelling the caller (a timeout)
    cancels the coroutine at its next await."""
    future = asyncio.run_coroutine_threadsafe(_captured(coroutine), env_loop())
    try:
        value, error = await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.cancel()
        raise
    if isinstance(error, Exception):
        raise error
    if error is not None:
        raise Escaped(f"{type(error).__name__}: {error}")
    return value


async def _captured(coroutine: Coroutine) -> tuple:
    # Inside the environments' loop a SystemExit would stop the loop itself (asyncio re-raises it out of
    # run_forever), so everything but cancellation comes back as a value.
    try:
        return await coroutine, None
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 -- the script's sys.exit() must not end the thread or the run
        return None, e
