"""A local HTTP/1.1 server for the tests of RL2's HTTP clients: on 127.0.0.1, one request per connection."""

import asyncio
import re


class LocalServer:
    """Subclasses answer in `respond(head, body, writer)`; `url` is set inside `async with`."""

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        body = await reader.readexactly(int(length.group(1)) if length else 0)
        await self.respond(head, body, writer)

    async def respond(self, head: bytes, body: bytes, writer) -> None:
        raise NotImplementedError


def response_head(status: int, length: int) -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
            f"Connection: close\r\n\r\n").encode()
