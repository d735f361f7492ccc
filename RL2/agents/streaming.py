"""Answers as server-sent events (`stream=true`), in the shape each API's client reads. The engine returns a call's
whole answer at once, so a stream is sent, in one write, once the answer is sampled (docs/agents.md, Streaming)."""

import json

from aiohttp import web

# Characters of text per delta event.
PIECE_CHARS = 32


async def send_events(request: web.Request, events: list[tuple[str | None, object]]) -> web.StreamResponse:
    """Answer `request` with `events`, each (its `event:` name, or None for data alone; its data: JSON, or text)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    lines = []
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        lines.append(f"event: {name}\ndata: {text}\n\n" if name else f"data: {text}\n\n")
    await response.write("".join(lines).encode())
    await response.write_eof()
    return response


def pieces(text: str) -> list[str]:
    """`text` as the deltas that stream it (none for no text)."""
    return [text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]
