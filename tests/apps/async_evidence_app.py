"""Planted async-server problems for tests/test_async_evidence.py (FastAPI under uvicorn, with
a ``BaseHTTPMiddleware``, so every route runs in a child task of its request's task).

Markers in comments name the lines the tests expect perfsleuth to point at.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.middleware.base import BaseHTTPMiddleware

app = FastAPI()


class Timing(BaseHTTPMiddleware):
    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        response.headers["x-app"] = "async-evidence"
        return response


app.add_middleware(Timing)

FEED = json.dumps([{"id": i, "name": f"item {i}", "tags": ["a", "b"]} for i in range(5000)])


def parse_feed() -> int:
    """The synchronous work an async handler does on the loop: 500 ms of JSON parsing."""
    t0 = time.perf_counter()
    rows = 0
    while time.perf_counter() - t0 < 0.5:
        rows += len(json.loads(FEED))  # PLANTED-DEEP
    return rows


@app.get("/block")
async def block() -> dict[str, Any]:
    rows = parse_feed()  # PLANTED-HANDLER
    return {"rows": rows}


@app.get("/health")
async def health() -> dict[str, Any]:
    return {"ok": True}


@app.post("/ingest")
async def ingest() -> dict[str, Any]:
    """Parses a big document on the loop and keeps it while it works: its allocations start
    the garbage collections that run meanwhile."""
    docs = [json.loads(FEED) for _ in range(60)]  # PLANTED-ALLOC
    return {"docs": len(docs)}


@app.get("/wait")
async def wait() -> dict[str, Any]:
    """Only waits: in flight while /ingest allocates, it allocates nothing itself."""
    await asyncio.sleep(0.8)
    return {"ok": True}


def burn_cpu(seconds: float) -> int:
    """Runs until this thread has used ``seconds`` of CPU (not of wall time)."""
    t0 = time.thread_time()
    n = 0
    while time.thread_time() - t0 < seconds:
        n += sum(i * i for i in range(1000))
    return n


@app.get("/cpu-sync")
def cpu_sync() -> dict[str, Any]:
    return {"n": burn_cpu(0.2)}


@app.get("/sleep-sync")
def sleep_sync() -> dict[str, Any]:
    time.sleep(0.2)
    return {"n": 0}


@app.get("/cpu-async")
async def cpu_async() -> dict[str, Any]:
    await asyncio.sleep(0)  # a second step of the request's task
    return {"n": burn_cpu(0.2)}


@app.get("/sleep-async")
async def sleep_async() -> dict[str, Any]:
    await asyncio.sleep(0.2)
    return {"n": 0}
