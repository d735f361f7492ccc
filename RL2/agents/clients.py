"""The OpenAI clients of an agent batch's runs (`RL2.agents.agent`): one HTTP connection pool per event loop, and a
client per run whose `close` leaves the pool to the batch."""

import asyncio

import openai

from RL2.rollout.event_loop import env_loop, on_env_loop


class Pools(dict[asyncio.AbstractEventLoop, openai.DefaultAsyncHttpxClient]):
    """The HTTP connection pool of a batch's clients (each run's its own `RunClient`) on each loop its runs ran
    on: a pool's connections belong to the loop that opened them."""

    def client(self, base_url: str, api_key: str) -> openai.AsyncOpenAI:
        """A client on the pool of the running loop (one of user code)."""
        loop = asyncio.get_running_loop()
        if loop not in self:
            self[loop] = openai.DefaultAsyncHttpxClient(timeout=None)
        return RunClient(base_url=base_url, api_key=api_key, max_retries=0, http_client=self[loop])

    async def aclose(self) -> None:
        # Only the current loop's: an abandoned loop may still be blocked, and its pool goes with it.
        if (http := self.get(env_loop())) is not None:
            await on_env_loop(http.aclose())


class RunClient(openai.AsyncOpenAI):
    """A run's client: an agent that closes it (`await client.close()`, `async with client:`) is done with it, and
    the pool stays open under the batch's other runs (the batch closes it)."""

    async def close(self) -> None:
        pass
