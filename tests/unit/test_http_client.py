"""The SGLang HTTP client against local servers that misbehave: one that wants an API key, one that
trickles its answer, one that returns token ids outside the vocabulary, one that drops every request,
one that answers without end.

The servers are a few lines of asyncio on 127.0.0.1 that answer `/generate` with a fixed body.
"""

import asyncio
import json
import os
import re
import stat
import subprocess
import sys
import time

import pytest

from RL2.config.errors import ConfigError
from RL2.config.server_args import check_server_args
from RL2.engine.protocol import EngineError
from RL2.engine.sglang import http_client
from RL2.engine.sglang.engine import SGLangEngine, control_request
from RL2.engine.sglang.http_client import HTTPEngineClient
from RL2.engine.sglang.server import SGLangServer
from tests.helpers.http import LocalServer, response_head
from tests.helpers.sglang import SGLANG_PYTHON, needs_sglang


def answer(ids: list[int]) -> dict:
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.5, i, None] for i in ids],
                                             "finish_reason": {"type": "length"}}}


class Server(LocalServer):
    """A local HTTP/1.1 server whose answer to every request `behaviour` decides.

    Args:
        behaviour: "answer" (200 with `body`), "trickle" (the body a byte every 0.1 s), "drop" (closes the
            connection after reading the request), "flood" (64 KiB chunks without a length, up to 64 MiB or
            until the client hangs up; `sent` counts the bytes).
        body: the JSON body of "answer" and "trickle".
        api_key: when set, a request without `Authorization: Bearer <api_key>` gets 401, as SGLang answers.
    """

    def __init__(self, behaviour: str = "answer", body: dict | None = None, api_key: str | None = None):
        self.behaviour, self.body, self.api_key = behaviour, body or answer([1, 2, 3]), api_key
        self.hits, self.authorizations, self.sent = 0, [], 0

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
        if self.behaviour == "flood":
            writer.write(b"HTTP/1.1 200 X\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
            try:
                while self.sent < 64 * 2**20:
                    writer.write(b" " * 2**16)
                    await writer.drain()
                    self.sent += 2**16
            except ConnectionError:
                pass
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


def test_the_servers_key_is_not_on_its_command_line(tmp_path):
    """Any local user reads a process's command line (`ps`): the key goes in a file of this user's alone,
    SGLang's --config, gone once the server is up (or shut down)."""
    (tmp_path / "mine.yaml").write_text("tp-size: 2\n")
    mine = {"api_key": "s3cret", "config": str(tmp_path / "mine.yaml")}  # the user's own --config is merged in
    for args, flags in (({"api_key": "s3cret"}, {"api-key": "s3cret"}), (mine, {"tp-size": 2, "api-key": "s3cret"})):
        server = SGLangServer(sys.executable, str(tmp_path), args, log_dir=str(tmp_path))
        try:
            assert not any("s3cret" in arg for arg in server.command) and "--api-key" not in server.command
            assert "s3cret" not in server.describe()
            path = server.command[server.command.index("--config") + 1]
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and json.loads(open(path).read()) == flags
        finally:
            server.shutdown()
        assert not os.path.exists(path)


@needs_sglang
def test_sglang_reads_the_key_from_its_config_file(tmp_path):
    """SGLang's own argument parsing (as `sglang.launch_server` calls it) finds the key in the file."""
    python = SGLANG_PYTHON
    server = SGLangServer(python, str(tmp_path), {"api_key": "s3cret", "device": "cpu"}, log_dir=str(tmp_path))
    parse = ("import sys; from sglang.srt.server_args import prepare_server_args; "
             "args = prepare_server_args(sys.argv[1:]); print(args.api_key, args.port, args.device)")
    try:
        out = subprocess.run([python, "-c", parse, *server.command[3:]], capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["s3cret", str(server.port), "cpu"]


def test_a_control_request_has_one_deadline_for_its_whole_answer():
    """As `test_a_request_has_one_deadline_for_its_whole_answer`, for weight updates and the other control requests."""
    async def main():
        async with Server("trickle") as server:
            began = time.monotonic()
            with pytest.raises(EngineError, match=rf"{server.url}/flush_cache failed \(no whole answer within 0.5 s\)"):
                await asyncio.to_thread(control_request, server.url, "/flush_cache", {}, 0.5)
            return time.monotonic() - began

    assert asyncio.run(main()) < 5  # the body alone takes ~8 s


def test_an_answer_past_the_size_cap_is_an_engine_error(monkeypatch):
    # raising=False: on a client without the cap the test fails below, where the answer is read whole
    monkeypatch.setattr(http_client, "MAX_ANSWER_BYTES", 1000, raising=False)
    big = answer(list(range(300)))  # ~3 kB with a Content-Length

    async def main():
        async with Server(body=big) as declared, Server("flood") as endless:
            for url in (declared.url, endless.url):
                with pytest.raises(EngineError, match=rf"{url}/generate answered with more than 1000 bytes"):
                    await HTTPEngineClient([url], timeout=30).generate(REQUEST)
                with pytest.raises(EngineError, match=rf"{url}/server_info answered with more than 1000 bytes"):
                    await asyncio.to_thread(control_request, url, "/server_info", None, 30.0)
            return endless.sent

    assert asyncio.run(main()) < 32 * 2**20  # the client hung up long before the 64 MiB of each flood
