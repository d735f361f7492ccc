"""An asyncio event loop running on a daemon thread of its own, for a component called from other loops or from none
(a script's MCP server connections, a judge), so that its connections and semaphores live on one loop for the run."""

import asyncio
import threading
from collections.abc import Coroutine


class LoopThread:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run_forever, name=name, daemon=True).start()

    def _run_forever(self) -> None:  # until `stop`; the loop closes on its own thread
        self.loop.run_forever()
        self.loop.close()

    def submit(self, coroutine: Coroutine):
        """Run `coroutine` on the loop: a `concurrent.futures.Future` of its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
