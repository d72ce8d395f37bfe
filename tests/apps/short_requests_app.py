"""Short requests doing a little CPU work each, for tests/test_starved_short_requests.py
(FastAPI under uvicorn): a sync endpoint (run in the thread pool) and an async one (on the
loop). Each does a fixed amount of work, a few milliseconds on a quiet machine: none is slow
enough to be stack-sampled, even when it waits for a CPU.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

app = FastAPI()


def work() -> int:
    return sum(i * i % 7 for i in range(20_000))


@app.get("/sync")
def sync_work() -> dict[str, Any]:
    return {"n": work()}


@app.get("/async")
async def async_work() -> dict[str, Any]:
    return {"n": work()}


@app.get("/health")
async def health() -> dict[str, Any]:
    return {"ok": True}
