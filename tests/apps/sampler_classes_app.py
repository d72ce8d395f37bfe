"""Planted CPU work, planted waits and a bystander of the GIL for tests/test_sampler_classes.py
(FastAPI under uvicorn).

The CPU endpoints do a fixed amount of work measured on the thread's own CPU clock, so they
take longer on a busy machine but always do the same work. Markers name the planted lines.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI

app = FastAPI()


def crunch(n: int) -> int:
    total = 0
    for i in range(n):
        total += (i * i) % 7  # PLANTED-CPU
    return total


@app.get("/cpu")
def cpu() -> dict[str, Any]:
    """A sync endpoint (thread pool) computing for 0.4 s of its thread's CPU time."""
    t0 = time.thread_time()
    n = 0
    while time.thread_time() - t0 < 0.4:
        n += crunch(5_000)
    return {"n": n}


@app.get("/sleep")
def sleep() -> dict[str, Any]:
    """A sync endpoint (thread pool) waiting 0.5 s without using the CPU."""
    time.sleep(0.5)  # PLANTED-SLEEP
    return {"ok": True}


@app.get("/await")
async def await_() -> dict[str, Any]:
    """An async endpoint awaiting 0.5 s."""
    await asyncio.sleep(0.5)  # PLANTED-AWAIT
    return {"ok": True}


@app.get("/bystander")
def bystander() -> dict[str, Any]:
    """A sync endpoint (thread pool) with next to nothing to do: it gives the GIL up 80 times
    (a sleep of 0) and takes it back each time, so beside a thread that computes it waits for
    the GIL about 5 ms (the switch interval) each time."""
    for _ in range(80):
        time.sleep(0)  # PLANTED-GIL
    return {"ok": True}


@app.get("/fast")
async def fast() -> dict[str, Any]:
    return {"ok": True}
