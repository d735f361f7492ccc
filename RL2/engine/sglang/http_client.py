"""HTTP to SGLang servers: `/generate` requests (`RL2.engine.protocol`) go to the least busy server, which is trusted
no further than that protocol (`HTTPEngineClient`); control requests go to one server (`control_request`)."""

import asyncio
import concurrent.futures
import json
import uuid

import httpx

from RL2.engine.protocol import EngineError
from RL2.utils.logging import log_rank0

# Seconds to open a connection: a server that does not accept within this is taken as down.
CONNECT_TIMEOUT = 10.0
# Seconds one control request (weight update, memory release) may take.
CONTROL_TIMEOUT = 600.0
# The largest answer body read from a server (a /generate answer of 100k tokens with their
# log-probabilities is ~10 MB): a larger one is an EngineError, not a trainer out of memory.
MAX_ANSWER_BYTES = 256 * 2**20


class HTTPEngineClient:
    """Sends `/generate` requests to SGLang servers, each to the one with the fewest in flight. A server that refuses,
    resets or closes a connection is given up for good with a warning, its requests going to the others; one with no
    whole answer within `timeout` seconds is not: a slow server is not a dead one."""

    def __init__(self, urls: list[str], timeout: float = 600.0, api_key: str | None = None,
                 vocab_size: int | None = None):
        if not urls:
            raise ValueError("HTTPEngineClient needs at least one server URL")
        self.urls = [url.rstrip("/") for url in urls]
        self.timeout, self.api_key, self.vocab_size = timeout, api_key, vocab_size
        self.lost: dict[str, str] = {}  # server URL -> why it was given up
        self._inflight = dict.fromkeys(self.urls, 0)
        self._own: dict[str, str] = {}  # request id -> server, of this client's requests in flight
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def generate(self, payload: dict) -> dict:
        """POST `payload` to the least busy server's `/generate`, again on another one if that server is lost."""
        # A request id of our own, so that `abort_own` can stop this client's requests and no others.
        payload = {"rid": uuid.uuid4().hex} | payload
        while True:
            url = self._least_busy()
            self._inflight[url] += 1
            self._own[payload["rid"]] = url
            try:
                answer = await self._post(f"{url}/generate", payload)
            except _Unreachable as e:
                # Sampling holds no state on the server: the request can start over on another one.
                self._give_up(url, str(e))
                continue
            finally:
                self._inflight[url] -= 1
                self._own.pop(payload["rid"], None)
            self._check_token_ids(url, answer)
            return answer

    async def abort_own(self) -> None:
        """Abort this client's requests in flight (SGLang `/abort_request` by id): they return at once
        with finish_reason abort and their partial output. Other clients' requests go on."""
        own = list(self._own.items())
        await asyncio.gather(*(self._post(f"{url}/abort_request", {"rid": rid}) for rid, url in own))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _least_busy(self) -> str:
        live = [url for url in self.urls if url not in self.lost]
        if not live:
            why = "; ".join(f"{url}: {reason}" for url, reason in self.lost.items())
            raise EngineError(f"no SGLang server is left to generate with, all were lost ({why}). Check that the "
                              f"servers run and are reachable from this host (rollout.server_url, or the logs of "
                              f"launched servers in rollout.server_log_dir)")
        return min(live, key=self._inflight.__getitem__)

    def _give_up(self, url: str, reason: str) -> None:
        if url not in self.lost:
            self.lost[url] = reason
            left = len(self.urls) - len(self.lost)
            log_rank0(f"WARNING: SGLang server {url} is lost ({reason}); "
                      + (f"its requests go to the {left} other(s)" if left else "no other server is left"))

    def _check_token_ids(self, url: str, answer: dict) -> None:
        """EngineError naming the server when an answer holds a token id outside the vocabulary: it would
        index past the trainer's embedding (an error far from its cause, or on GPU a device assert)."""
        if self.vocab_size is None or not isinstance(answer, dict):
            return
        ids = list(answer.get("output_ids") or [])
        ids += [entry[1] for entry in (answer.get("meta_info") or {}).get("output_token_logprobs") or []
                if isinstance(entry, (list, tuple)) and len(entry) > 1]
        # output_ids and the log-probabilities' ids are the same tokens: each bad one listed once
        bad = list(dict.fromkeys(i for i in ids if isinstance(i, bool) or not isinstance(i, int)
                                 or not 0 <= i < self.vocab_size))
        if bad:
            raise EngineError(f"{url}/generate returned token ids outside the model's vocabulary of {self.vocab_size}: "
                              f"{bad[:5]}{' ...' if len(bad) > 5 else ''}. The server does not serve the actor's "
                              f"model (check rollout.server_url and the model it was started with)")

    async def _post(self, endpoint: str, payload: dict) -> dict:
        try:
            status, body = await asyncio.wait_for(read_answer(self._http(), endpoint, payload, self.api_key),
                                                  self.timeout)
        except (httpx.TimeoutException, asyncio.TimeoutError) as e:
            raise EngineError(f"{endpoint}: no answer within {self.timeout} s ({type(e).__name__}); a request may "
                              f"take rollout.request_timeout seconds") from e
        except httpx.TransportError as e:
            raise _Unreachable(f"{endpoint} is unreachable ({type(e).__name__}: {e})") from e
        check_status(endpoint, status, body)
        try:
            return json.loads(body) if body else {}  # control endpoints may answer with an empty body
        except ValueError as e:
            raise EngineError(f"{endpoint} returned a body that is not JSON: {body[:200]!r}") from e

    def _http(self) -> httpx.AsyncClient:
        # An httpx client's connections belong to the event loop that opened them: a fresh client for each loop.
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            timeout = httpx.Timeout(self.timeout, connect=min(CONNECT_TIMEOUT, self.timeout), pool=None)
            # No cap on connections: every trajectory of a batch keeps one request open at a time.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
            self._loop = loop
        return self._client


def control_request(url: str, endpoint: str, payload: dict | None = None, timeout: float = CONTROL_TIMEOUT,
                    absent_ok: bool = False, api_key: str | None = None) -> dict | None:
    """One control request (GET without a payload, else POST); EngineError unless the server answers 200 and
    success within `timeout` seconds. With `absent_ok`, None if the server has no such endpoint (404)."""

    async def send() -> tuple[int, bytes]:
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await asyncio.wait_for(read_answer(client, f"{url}{endpoint}", payload, api_key), timeout)

    try:
        status, answer = _run_blocking(send())
    except TimeoutError as e:
        raise EngineError(f"{url}{endpoint} failed (no whole answer within {timeout} s)") from e
    except httpx.HTTPError as e:
        raise EngineError(f"{url}{endpoint} failed ({type(e).__name__}: {e})") from e
    if absent_ok and status == 404:
        return None
    check_status(f"{url}{endpoint}", status, answer)
    try:
        body = json.loads(answer)
    except ValueError:
        return {}
    # Weight updates answer 200 with {"success": false, "message": ...} when the weights do not fit.
    if isinstance(body, dict) and body.get("success") is False:
        raise EngineError(f"{url}{endpoint} failed: {body.get('message', body)}")
    return body if isinstance(body, dict) else {}


def _run_blocking(coroutine):
    """Run `coroutine` from sync code, in a thread of its own if this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def read_answer(client: httpx.AsyncClient, url: str, payload: dict | None,
                      api_key: str | None) -> tuple[int, bytes]:
    """POST `payload` to `url` (GET when None): the status and body, of at most MAX_ANSWER_BYTES (else EngineError,
    having read no more). The caller bounds its whole time: httpx's read timeout restarts at every chunk received."""
    method = "GET" if payload is None else "POST"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with client.stream(method, url, json=payload, headers=headers) as response:
        declared = response.headers.get("content-length", "")
        too_big = declared.isdigit() and int(declared) > MAX_ANSWER_BYTES
        body = bytearray()
        if not too_big:
            async for chunk in response.aiter_bytes():  # decompressed: a small compressed body cannot explode
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    too_big = True
                    break
        if too_big:
            raise EngineError(f"{url} answered with more than {MAX_ANSWER_BYTES} bytes (RL2's cap on an answer); "
                              f"the server is not an SGLang server answering as RL2 asked")
        return response.status_code, bytes(body)


def check_status(where: str, status: int, body: bytes) -> None:
    """EngineError unless the server answered the request to `where` (its URL) with 200."""
    text = body.decode(errors="replace")
    if status in (401, 403):
        raise EngineError(f"{where} refused the request (HTTP {status}: {text[:200]}): "
                          f"set rollout.api_key to the key the server was started with (--api-key)")
    if status != 200:
        raise EngineError(f"{where} returned HTTP {status}: {text[:500]}")


class _Unreachable(EngineError):
    """The server could not be reached or dropped the connection: it is lost, not just slow."""
