"""The one event loop of a rank's rollouts, kept for the whole run.

Every rollout, evaluation and partial-rollout round of a process runs on this loop, so what an
environment script or an agent makes at import or in its first rollout (an `asyncio.Lock`, a
semaphore, an HTTP client session, the OpenAI endpoint's server) still works in the next one. A new
loop per rollout (`asyncio.run`) would leave such objects bound to a closed loop ("... is bound to a
different event loop" on the second rollout).
"""

import asyncio
import atexit
from collections.abc import Coroutine

_loop: asyncio.AbstractEventLoop | None = None


def rank_loop() -> asyncio.AbstractEventLoop:
    """This process's rollout loop, made at the first call and closed at exit."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
        atexit.register(close_rank_loop)
    return _loop


def run_on_rank_loop(coroutine: Coroutine):
    """Run `coroutine` to its end on the rank's loop (from outside any running loop)."""
    return rank_loop().run_until_complete(coroutine)


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
