"""Planted runtime problems for tests/test_evidence.py (FastAPI under uvicorn).

Markers in comments name the lines the tests expect perfsleuth to point at.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from typing import Any

from fastapi import FastAPI

app = FastAPI()

PAYLOAD = json.dumps(
    {"rows": [{"id": i, "name": f"row {i}", "tags": ["a", "b"]} for i in range(5000)]}
)


def crunch(n: int) -> int:
    total = 0
    for i in range(n):
        total += (i * i) % 7  # PLANTED-HOTSPOT
    return total


@app.get("/hot")
def hot() -> dict[str, Any]:
    """A sync endpoint (run in the thread pool) burning ~0.5 s of CPU in crunch()."""
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.5:
        n += crunch(20_000)
    return {"n": n}


@app.post("/parse")
async def parse() -> dict[str, Any]:
    """An async endpoint parsing JSON synchronously for 300 ms: the loop is blocked."""
    t0 = time.perf_counter()
    rows = 0
    while time.perf_counter() - t0 < 0.3:
        rows += len(json.loads(PAYLOAD)["rows"])  # PLANTED-BLOCK
    return {"rows": rows}


_db = sqlite3.connect(":memory:", check_same_thread=False)
_db.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT)")
_db.executemany("INSERT INTO items VALUES (?, ?)", ((i, f"item {i}") for i in range(50_000)))


@app.post("/import-rows")
async def import_rows() -> dict[str, Any]:
    """Loads 50,000 rows, then turns them into objects on the loop for 300 ms."""
    rows = _db.execute("SELECT id, name FROM items").fetchall()
    t0 = time.perf_counter()
    out: list[dict[str, Any]] = []
    while time.perf_counter() - t0 < 0.3:
        out = [{"id": i, "name": n.upper()} for i, n in rows]  # PLANTED-ROWS
    return {"rows": len(out)}


@app.get("/items/count")
def items_count() -> dict[str, Any]:
    """A sync endpoint (thread pool) making one query: its call stack crosses the agent's
    thread-pool wrapper, which must not show in it."""
    return {"n": _db.execute("SELECT count(*) FROM items").fetchone()[0]}


@app.get("/slow-wait")
async def slow_wait() -> dict[str, Any]:
    """Waits (does not block): in flight while /parse blocks, so it is delayed."""
    await asyncio.sleep(0.6)  # PLANTED-AWAIT
    return {"ok": True}


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic GC frees it


@app.get("/alloc")
def alloc() -> dict[str, Any]:
    """Creates cyclic garbage: garbage collections run while this request is in flight."""
    n = 0
    for _ in range(20):
        junk = [Node() for _ in range(20_000)]
        n += len(junk)
    return {"n": n}


@app.get("/fast")
async def fast() -> dict[str, Any]:
    return {"ok": True}
