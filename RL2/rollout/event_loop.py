"""The event loops of a rank's rollouts: one per process for every rollout (`run_on_rank_loop`), so that what an
agent or the engine makes in one rollout (an HTTP session, the OpenAI endpoint's server) works in the next, and
one for user code in a daemon thread (`on_env_loop`), left to a call that blocks it past its timeout, the calls
waiting to start moving to a new one (Python cannot stop a thread): docs/rl.md, "Environments".
"""

import asyncio
import atexit
import itertools
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from RL2.loop_thread import LoopThread

BLOCKED_AFTER_S = 1.0  # seconds the loop of a call that timed out has to answer before it is taken to be blocked

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()  # guards `_user_loop`, and where each call is sent and whether it has started
_user_loop: "_UserLoop | None" = None
_numbers = itertools.count(1)


class Escaped(Exception):
    """What user code raised that is not an `Exception` (`sys.exit()`, `KeyboardInterrupt`, a `CancelledError`
    of its own): it ends one trajectory, as an exception of the script does, instead of the trainer."""


def run_on_rank_loop(coroutine: Coroutine):
    """Run `coroutine` on the rank's loop (from outside any running loop), made at the first call, closed at exit."""
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


class _UserLoop(LoopThread):
    """A loop for user code and the daemon thread running it; once abandoned, it stops when its calls end."""

    def __init__(self):
        self.waiting: set[_Call] = set()  # sent here, not started yet
        self.abandoned = False
        super().__init__(f"rl2-env-loop-{next(_numbers)}")

    def _run_forever(self) -> None:
        while True:
            try:
                return super()._run_forever()  # stopped: abandoned, and its calls ended
            except (SystemExit, KeyboardInterrupt):
                # Raised in a task that user code made (a child of its gather): asyncio re-raises these out of
                # run_forever. The call that awaits that task gets it as its outcome; the loop goes on.
                continue


@dataclass(eq=False)
class _Call:
    """One coroutine of user code, awaited from the `caller` loop."""

    coroutine: Coroutine
    caller: asyncio.AbstractEventLoop
    started: asyncio.Future  # on the caller's loop, like `done`, which gets (value, what it raised)
    done: asyncio.Future
    home: _UserLoop | None = None
    task: asyncio.Task | None = None  # on `home`, once started
    given_up: bool = False


def env_loop() -> asyncio.AbstractEventLoop:
    """The loop user code runs on now; made at the first call, and again after one is abandoned."""
    with _lock:
        return _current().loop


async def on_env_loop(coroutine: Coroutine, timeout: float | None = None):
    """Await `coroutine` (user code: a step, a reset, tool calls, an agent's run) run on the loop of user code, for
    at most `timeout` seconds once it has started (None: no limit), then cancelled (its loop left to it if it blocks
    it) with a TimeoutError. What it raises is raised here (a `BaseException` that is no `Exception` as `Escaped`);
    cancelling the caller cancels it."""
    caller = asyncio.get_running_loop()
    call = _Call(coroutine, caller, caller.create_future(), caller.create_future())
    with _lock:
        _send(call, _current())
    try:
        await call.started
        finished, _ = await asyncio.wait([call.done], timeout=timeout)
    except asyncio.CancelledError:
        _give_up(call)
        raise
    if not finished:
        _give_up(call)
        await _abandon_if_blocked(call.home)
        raise TimeoutError(f"user code did not return within {timeout} s")
    value, error = call.done.result()
    if isinstance(error, Exception):
        raise error
    if error is not None:
        raise Escaped(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
    return value


def _current() -> _UserLoop:
    """The loop new calls go to (with `_lock` held)."""
    global _user_loop
    if _user_loop is None:
        _user_loop = _UserLoop()
    return _user_loop


def _send(call: _Call, home: _UserLoop) -> None:
    """Queue `call` to start on `home` (with `_lock` held)."""
    call.home = home
    home.waiting.add(call)
    home.loop.call_soon_threadsafe(lambda: home.loop.create_task(_run(call, home)))


async def _run(call: _Call, home: _UserLoop) -> None:
    """Run `call` on `home`'s loop, unless it moved or its caller gave up meanwhile. It starts here, in the task's
    first step, not when the task is made: a call made ready behind one that then blocks has not started, and moves."""
    with _lock:
        if call.home is not home or call.given_up:
            return
        home.waiting.discard(call)
        call.task = asyncio.current_task()
    _post(call.caller, _resolve, call.started, None)
    # Inside a task, a SystemExit or KeyboardInterrupt would stop the loop itself, so all the script raises comes
    # back as a value; a CancelledError too (a caller that cancelled reads no value; the script's own is its fault).
    try:
        outcome = await call.coroutine, None
    except BaseException as e:  # noqa: BLE001 -- the script's sys.exit() must not end the thread or the run
        outcome = None, e
    _post(call.caller, _resolve, call.done, outcome)


def _give_up(call: _Call) -> None:
    """Cancel a call nobody waits for any more; one that has not started never will."""
    with _lock:
        call.given_up = True
        if call.task is None:
            call.home.waiting.discard(call)
            call.coroutine.close()
            return
    _post(call.home.loop, call.task.cancel)


async def _abandon_if_blocked(home: _UserLoop) -> None:
    """Leave `home` to the call blocking it when its loop does not answer within BLOCKED_AFTER_S: later calls,
    and those waiting there, go to a new loop; `home` stops once the calls it started have ended."""
    global _user_loop
    caller = asyncio.get_running_loop()
    answer = caller.create_future()
    # `home`'s loop answers by resolving `answer` on the caller's; False: closed, it was abandoned and has stopped.
    if not _post(home.loop, _post, caller, _resolve, answer, None):
        return
    answered, _ = await asyncio.wait([answer], timeout=BLOCKED_AFTER_S)
    if answered:
        return
    with _lock:
        if home.abandoned:
            return
        home.abandoned, _user_loop = True, None
        moved, home.waiting = home.waiting, set()
        for call in moved:
            _send(call, _current())
    _post(home.loop, lambda: home.loop.create_task(_retire(home)))


async def _retire(home: _UserLoop) -> None:
    """On an abandoned loop free again: wait for what it still runs, then stop it (its thread then closes it)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    await asyncio.gather(*others, return_exceptions=True)
    home.loop.stop()


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> bool:
    """Have `loop` call `fn(*args)`, from any thread; False when the loop is closed (nobody would)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: its caller left (asyncio.run ended), or it was retired
        return False
    return True


def _resolve(future: asyncio.Future, value) -> None:
    """Give `future` its result, on its own loop (`_post` it there from another thread)."""
    if not future.done():  # a caller that was cancelled cancelled it
        future.set_result(value)
