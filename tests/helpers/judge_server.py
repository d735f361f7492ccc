"""A judge for the tests: a chat-completions server on 127.0.0.1 that answers by the question a rubric shows."""

import asyncio
import re
import threading

from aiohttp import web

# The tests' rubric: the server reads its command from the question.
RUBRIC = "Q: {question}\nA: {response}"


class JudgeServer:
    """A chat-completions server on 127.0.0.1, in a thread of its own, answering by the question the rubric
    shows ("Q: <command>"): `score N` answers <score>N</score>; `fail` HTTP 500; `once` HTTP 500 on its first
    request, then <score>5</score>; `hang` never answers (until the server stops); `text` an answer without a
    score; `wait K` holds each request until K of its batch of K have arrived, then answers <score>4</score>."""

    def __init__(self):
        self.requests: list[dict] = []
        self.in_flight = self.peak = self.arrived = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._serve, daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    def _serve(self) -> None:
        self.loop.run_forever()
        self.loop.close()

    async def _start(self) -> str:
        self.changed, self.stopping = asyncio.Condition(), asyncio.Event()
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", self.complete)])
        self.runner = web.AppRunner(app, shutdown_timeout=1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        command = re.match(r"Q: (.*)\n", body["messages"][-1]["content"]).group(1)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            return await self._answer(command)
        finally:
            self.in_flight -= 1

    async def _answer(self, command: str) -> web.Response:
        if command.startswith("wait"):
            batch = int(command.split()[1])
            target = (self.arrived // batch + 1) * batch
            async with self.changed:
                self.arrived += 1
                self.changed.notify_all()
                await asyncio.wait_for(self.changed.wait_for(lambda: self.arrived >= target), 30)
            command = "score 4"
        if command == "fail" or (command == "once" and self.asked("once") == 1):
            return web.json_response({"error": {"message": "overloaded"}}, status=500)
        if command == "hang":
            await self.stopping.wait()
        content = "Looks fine to me." if command == "text" else (
            f"<score>{command.split()[1]}</score>" if command.startswith("score") else "<score>5</score>")
        return web.json_response({
            "id": "1", "object": "chat.completion", "created": 0, "model": "judge",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
        })

    def asked(self, command: str) -> int:
        return sum(body["messages"][-1]["content"].startswith(f"Q: {command}\n") for body in self.requests)

    def stop(self) -> None:
        async def stop():
            self.stopping.set()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
