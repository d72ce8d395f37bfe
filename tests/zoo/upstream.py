"""A fake third-party HTTP service the zoo apps call: an avatar service and a pricing API
with a slow and a fast quote endpoint. It runs in a thread of the harness process and is not
instrumented (it is "their" service)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

SLOW_QUOTE_S = 0.2  # upstream_latency: the slow upstream's answer time


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real HTTP clients expect
    # Headers and body go out in separate writes: without this, Nagle and delayed ACKs add
    # ~40 ms to every response on a kept-alive connection.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if url.path == "/health":
            self._send({"status": "ok"})
        elif parts[0] == "avatars" and len(parts) == 2 and parts[1].isdigit():
            self._send(_avatar(int(parts[1])))
        elif url.path == "/avatars":  # the batch endpoint the clean twin uses
            ids = parse_qs(url.query).get("ids", [""])[0].split(",")
            self._send([_avatar(int(i)) for i in ids if i.isdigit()])
        elif url.path == "/quotes/slow":
            time.sleep(SLOW_QUOTE_S)
            self._send({"price_cents": 1299, "source": "slow"})
        elif url.path == "/quotes/fast":
            self._send({"price_cents": 1299, "source": "fast"})
        else:
            self._send({"error": "not found"}, 404)

    def _send(self, body: Any, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


def _avatar(user_id: int) -> dict[str, Any]:
    return {"user_id": user_id, "url": f"https://avatars.example/{user_id}.png"}


@contextmanager
def serving() -> Iterator[str]:
    """Serve on a free port for the duration of the block; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="zoo-upstream", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
