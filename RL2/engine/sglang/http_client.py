"""The HTTP client of SGLang servers: `/generate` requests go to the least busy server.

Requests and responses are SGLang's `POST /generate` JSON (`RL2.engine.protocol`).
"""

import asyncio
import uuid

import httpx

from RL2.engine.protocol import EngineError

# Seconds to open a connection: a server that does not accept within this is taken as down.
CONNECT_TIMEOUT = 10.0


class HTTPEngineClient:
    """Sends `/generate` requests to SGLang servers, each to the one with the fewest in flight.

    Args:
        urls: server base URLs, e.g. ["http://10.0.0.1:30000"].
        timeout: seconds to wait for one response (generation included) before failing.
    """

    def __init__(self, urls: list[str], timeout: float = 600.0):
        if not urls:
            raise ValueError("HTTPEngineClient needs at least one server URL")
        self.urls = [url.rstrip("/") for url in urls]
        self.timeout = timeout
        self._inflight = dict.fromkeys(self.urls, 0)
        self._own: dict[str, str] = {}  # request id -> server, of this client's requests in flight
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def generate(self, payload: dict) -> dict:
        """POST `payload` to `{url}/generate` on the least busy server; raises `EngineError`."""
        url = min(self.urls, key=self._inflight.__getitem__)
        # A request id of our own, so that `abort_own` can stop this client's requests and no others.
        payload = {"rid": uuid.uuid4().hex} | payload
        self._inflight[url] += 1
        self._own[payload["rid"]] = url
        try:
            return await self._post(f"{url}/generate", payload)
        finally:
            self._inflight[url] -= 1
            self._own.pop(payload["rid"], None)

    async def abort_own(self) -> None:
        """Abort this client's requests in flight (SGLang `/abort_request` by id): they return at once
        with finish_reason abort and their partial output. Other clients' requests go on."""
        await asyncio.gather(*(self._post(f"{url}/abort_request", {"rid": rid}) for rid, url in list(self._own.items())))

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pause every server (SGLang `/pause_generation`). With "abort", in-flight requests return at
        once with finish_reason abort and their partial output; "retract" and "in_place" hold them."""
        await asyncio.gather(*(self._post(f"{url}/pause_generation", {"mode": mode}) for url in self.urls))

    async def continue_generation(self) -> None:
        await asyncio.gather(*(self._post(f"{url}/continue_generation", {}) for url in self.urls))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _post(self, endpoint: str, payload: dict) -> dict:
        try:
            response = await self._http().post(endpoint, json=payload)
        except httpx.TimeoutException as e:
            raise EngineError(f"{endpoint}: no answer within {self.timeout} s ({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise EngineError(f"{endpoint} is unreachable ({type(e).__name__}: {e})") from e
        if response.status_code != 200:
            raise EngineError(f"{endpoint} returned HTTP {response.status_code}: {response.text[:500]}")
        if not response.content:  # control endpoints may answer with an empty body
            return {}
        try:
            return response.json()
        except ValueError as e:
            raise EngineError(f"{endpoint} returned a body that is not JSON: {response.text[:200]!r}") from e

    def _http(self) -> httpx.AsyncClient:
        # An httpx client's connections belong to the event loop that opened them; trainers that call
        # `asyncio.run` once per rollout get a fresh client for each loop.
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            timeout = httpx.Timeout(self.timeout, connect=min(CONNECT_TIMEOUT, self.timeout), pool=None)
            # No cap on connections: every trajectory of a batch keeps one request open at a time.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
            self._loop = loop
        return self._client
