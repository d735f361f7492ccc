"""The viewer's web server: the page's static files and a JSON API over one run (`answer`), on 127.0.0.1 only.
Each request reads what the run appended since the last (`Run.refresh`), so the page follows a running job."""

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from RL2.viewer.run import Run

STATIC = Path(__file__).parent / "static"
HOST = "127.0.0.1"  # the run's text is the model's and the environment's: never served beyond this machine
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
# Nothing but the page's own files runs or loads, even if some text of the run were ever parsed as HTML.
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}
MAX_PAGE = 500


def filters_of(one: dict[str, str]) -> dict:
    """The `Run.query` filters of a request's query (key -> last value); a malformed number raises ValueError."""
    one = {key: value for key, value in one.items() if value != ""}
    filters = {"fault": one.get("fault"), "source": one.get("source"), "q": one.get("q"),
               "tool_errors": one.get("tool_errors") in ("1", "true"), "split": one.get("split") in ("1", "true")}
    filters["step"] = int(one["step"]) if "step" in one else None
    for key in ("min_reward", "max_reward"):
        filters[key] = float(one[key]) if key in one else None
    return filters


def answer(run: Run, path: str, query: dict[str, list[str]]):
    """The JSON of one API request, or None for an unknown path."""
    one = {key: values[-1] for key, values in query.items() if values}
    routes = {
        "/api/status": run.status,
        "/api/metrics": run.metrics,
        "/api/steps": run.steps,
        "/api/samples": lambda: run.query(filters_of(one), max(int(one.get("offset", 0)), 0),
                                          max(min(int(one.get("limit", 50)), MAX_PAGE), 1)),
        "/api/sample": lambda: run.sample(int(one["id"])),
        "/api/group": lambda: run.group(int(one["step"]), int(one["group"])),
        "/api/same_prompt": lambda: run.same_prompt(int(one["id"])),
    }
    if path not in routes:
        return None
    run.refresh()
    return routes[path]()


def make_handler(run: Run) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            if url.path.startswith("/api/"):
                try:
                    body = answer(run, url.path, parse_qs(url.query))
                except (KeyError, ValueError) as e:
                    return self.send(HTTPStatus.BAD_REQUEST, {"error": f"bad query: {e}"})
                if body is None and url.path not in ("/api/sample",):
                    return self.send(HTTPStatus.NOT_FOUND, {"error": f"no endpoint {url.path}"})
                return self.send(HTTPStatus.OK, body)
            name = "index.html" if url.path in ("/", "/index.html") else url.path.lstrip("/").removeprefix("static/")
            files = {p.name: p for p in STATIC.iterdir()}  # only the page's own files: no path reaches elsewhere
            if name not in files:
                return self.send(HTTPStatus.NOT_FOUND, {"error": "not found"})
            self.send_bytes(HTTPStatus.OK, files[name].read_bytes(), TYPES.get(files[name].suffix, "text/plain"))

        def send(self, status: HTTPStatus, body) -> None:
            self.send_bytes(status, json.dumps(body, allow_nan=False, default=str).encode(), "application/json")

        def send_bytes(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for key, value in HEADERS.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # quiet: the terminal shows the address only
            pass

    return Handler


def serve(save_dir: str | Path, port: int = 8765) -> ThreadingHTTPServer:
    """A server of `save_dir` on 127.0.0.1:`port` (0: any free port), running on a thread of its own; its
    address is `server.server_address`. Stop it with `server.shutdown()`."""
    server = ThreadingHTTPServer((HOST, port), make_handler(Run(save_dir)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
