"""The SGLang HTTP client against local servers that misbehave: one that wants an API key, one that
trickles its answer, one that returns token ids outside the vocabulary, one that drops every request.

The servers are a few lines of asyncio on 127.0.0.1 that answer `/generate` with a fixed body.
"""

import asyncio
import json
import re
import sys
import time

import pytest

from RL2.config.errors import ConfigError
from RL2.config.server_args import check_server_args
from RL2.engine.protocol import EngineError
from RL2.engine.sglang.engine import SGLangEngine, control_request
from RL2.engine.sglang.http_client import HTTPEngineClient
from RL2.engine.sglang.server import SGLangServer
from tests.helpers.http import LocalServer, response_head


def answer(ids: list[int]) -> dict:
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.5, i, None] for i in ids],
                                             "finish_reason": {"type": "length"}}}


class Server(LocalServer):
    """A local HTTP/1.1 server whose answer to every request `behaviour` decides.

    Args:
        behaviour: "answer" (200 with `body`), "trickle" (the body a byte every 0.1 s), "drop" (closes the
            connection after reading the request).
        body: the JSON body of "answer" and "trickle".
        api_key: when set, a request without `Authorization: Bearer <api_key>` gets 401, as SGLang answers.
    """

    def __init__(self, behaviour: str = "answer", body: dict | None = None, api_key: str | None = None):
        self.behaviour, self.body, self.api_key = behaviour, body or answer([1, 2, 3]), api_key
        self.hits, self.authorizations = 0, []

    async def respond(self, head: bytes, body: bytes, writer) -> None:
        authorization = re.search(rb"authorization: *([^\r\n]*)", head, re.IGNORECASE)
        self.authorizations.append(authorization.group(1).decode() if authorization else None)
        self.hits += 1
        status, body = 200, json.dumps(self.body).encode()
        if self.api_key is not None and self.authorizations[-1] != f"Bearer {self.api_key}":
            status, body = 401, b'{"error": "Unauthorized"}'
        if self.behaviour == "drop":
            writer.close()
            return
        writer.write(response_head(status, len(body)))
        if self.behaviour == "trickle":
            for i in range(len(body)):
                writer.write(body[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0.1)
        else:
            writer.write(body)
        await writer.drain()
        writer.close()


REQUEST = {"input_ids": [1, 2], "sampling_params": {}}


def test_the_api_key_goes_with_every_request():
    async def main():
        async with Server(api_key="s3cret") as server:
            assert (await HTTPEngineClient([server.url], api_key="s3cret").generate(REQUEST))["output_ids"] == [1, 2, 3]
            with pytest.raises(EngineError, match=rf"{server.url}/generate refused .*401.*rollout\.api_key"):
                await HTTPEngineClient([server.url]).generate(REQUEST)
            control = await asyncio.to_thread(control_request, server.url, "/update_weights_from_disk", {}, 5.0,
                                              api_key="s3cret")
            with pytest.raises(EngineError, match=r"/flush_cache refused .*rollout\.api_key"):
                await asyncio.to_thread(control_request, server.url, "/flush_cache", {}, 5.0)
            return server.authorizations, control

    authorizations, control = asyncio.run(main())
    assert authorizations == ["Bearer s3cret", None, "Bearer s3cret", None]
    assert control["output_ids"] == [1, 2, 3]


def test_a_request_has_one_deadline_for_its_whole_answer():
    """A server trickling a byte every 0.1 s never lets httpx's per-read timeout expire; the request's
    own deadline (rollout.request_timeout) still ends it."""
    async def main():
        async with Server("trickle") as server:
            began = time.monotonic()
            with pytest.raises(EngineError, match=rf"{server.url}/generate: no answer within 0.5 s"):
                await HTTPEngineClient([server.url], timeout=0.5).generate(REQUEST)
            return time.monotonic() - began

    assert asyncio.run(main()) < 5  # the body alone takes ~8 s


def test_token_ids_outside_the_vocabulary_name_the_server(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))

    async def main():
        async with Server(body=answer([5, 99])) as fine, Server(body=answer([5, 100])) as past, \
                Server(body=answer([-1])) as negative:
            engine = SGLangEngine([fine.url], [], "none", 1, str(tmp_path))  # the vocabulary of its model folder
            assert (await engine.generate(REQUEST))["output_ids"] == [5, 99]
            for server, bad in ((past, r"\[100\]"), (negative, r"\[-1\]")):
                client = HTTPEngineClient([server.url], vocab_size=engine.client.vocab_size)
                with pytest.raises(EngineError, match=rf"{server.url}/generate returned token ids outside the "
                                                      rf"model's vocabulary of 100: {bad}"):
                    await client.generate(REQUEST)

    asyncio.run(main())


def test_a_lost_servers_requests_go_to_the_others():
    async def main():
        async with Server("drop") as dead, Server() as alive:
            client = HTTPEngineClient([dead.url, alive.url], timeout=5)
            answers = await asyncio.gather(*(client.generate(REQUEST) for _ in range(6)))
            assert [a["output_ids"] for a in answers] == [[1, 2, 3]] * 6
            assert list(client.lost) == [dead.url] and alive.hits == 6
            hits = dead.hits
            await client.generate(REQUEST)
            assert dead.hits == hits  # given up: sent nothing more
            async with Server("drop") as other:
                client = HTTPEngineClient([dead.url, other.url], timeout=5)
                with pytest.raises(EngineError, match=rf"no SGLang server is left .*{dead.url}.*{other.url}"):
                    await client.generate(REQUEST)

    asyncio.run(main())


def test_launched_servers_take_the_key_from_rollout_api_key_only(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.server_args\.api_key.*set rollout\.api_key"):
        check_server_args({"api_key": "x"})
    with pytest.raises(ConfigError, match=r"rollout\.server_args\.admin-api-key"):
        check_server_args({"admin-api-key": "x"})
    server = SGLangServer(sys.executable, str(tmp_path), {"api_key": "s3cret"}, log_dir=str(tmp_path))
    assert server.command[server.command.index("--api-key") + 1] == "s3cret"
    assert "s3cret" not in server.describe() and "--api-key ***" in server.shown_command()
