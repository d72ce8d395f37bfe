"""A FastAPI app behind two BaseHTTPMiddlewares (``@app.middleware("http")``), for
tests/test_sampler_classes.py: each middleware runs what is below it in a child task and waits
for it at ``await call_next(request)``. Markers name the planted lines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response

app = FastAPI()


@app.middleware("http")
async def timing(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Any:
    t0 = time.perf_counter()
    response = await call_next(request)  # PLANTED-CALL-NEXT-OUTER
    response.headers["x-elapsed"] = f"{time.perf_counter() - t0:.3f}"
    return response


@app.middleware("http")
async def tagging(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Any:
    """A second BaseHTTPMiddleware: the endpoint runs two child tasks down."""
    response = await call_next(request)  # PLANTED-CALL-NEXT-INNER
    response.headers["x-tag"] = "1"
    return response


@app.get("/io")
async def io() -> dict[str, Any]:
    """Awaits 0.5 s: the time is spent at this await, below the middleware's."""
    await asyncio.sleep(0.5)  # PLANTED-IO
    return {"ok": True}


def crunch(n: int) -> int:
    total = 0
    for i in range(n):
        total += (i * i) % 7  # PLANTED-CRUNCH
    return total


@app.get("/crunch")
async def crunch_endpoint() -> dict[str, Any]:
    """Computes on the loop for 0.3 s of CPU time (in the middleware's child task)."""
    t0 = time.thread_time()
    n = 0
    while time.thread_time() - t0 < 0.3:
        n += crunch(5_000)
    return {"n": n}


@app.get("/health")
async def health() -> dict[str, Any]:
    return {"ok": True}
