"""A Flask app with a CPU hotspot, for sampling sync workers under gunicorn."""

from __future__ import annotations

import time

from flask import Flask

app = Flask(__name__)


def checksum(data: bytes) -> int:
    h = 0
    for b in data:
        h = (h * 31 + b) & 0xFFFFFFFF  # PLANTED-WSGI-HOTSPOT
    return h


@app.get("/checksum")
def route_checksum() -> dict[str, int]:
    t0 = time.perf_counter()
    h = 0
    while time.perf_counter() - t0 < 0.5:
        h ^= checksum(b"x" * 50_000)
    return {"h": h}


@app.get("/health")
def health() -> dict[str, bool]:
    return {"ok": True}
