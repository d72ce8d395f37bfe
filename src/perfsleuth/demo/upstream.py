"""A fake carrier API the shop calls over HTTP: slow, and slower for far-away cities.

Run as ``python -m perfsleuth.demo.upstream --port N``; it is not instrumented (it is "their"
service, whose slowness perfsleuth must tell apart from ours).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

# Their wait must stay most of the endpoint's time on a slow, loaded machine too (the
# upstream_latency detector asks for half): our own part of the request grows with the
# machine's slowness, so the base delay is large enough to stay over half on a machine three
# times slower than usual.
BASE_DELAY_S = 0.2
JITTER_S = 0.12
FAR_CITIES = {"Perth": 0.35, "Osaka": 0.25}  # extra seconds for the long-haul routes


class CarrierHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/health":
            self._send(200, {"status": "ok"})
            return
        parts = url.path.strip("/").split("/")
        if len(parts) != 3 or parts[:2] != ["v1", "quotes"]:
            self._send(404, {"error": "not found"})
            return
        city = parts[2]
        weight = int((parse_qs(url.query).get("weight_g") or ["1000"])[0])
        time.sleep(BASE_DELAY_S + random.random() * JITTER_S + FAR_CITIES.get(city, 0.0))
        self._send(200, {"carrier": "slowship", "city": city,
                         "price_cents": 499 + weight // 10, "days": 3})  # fmt: skip

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8899)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), CarrierHandler)
    server.daemon_threads = True
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
