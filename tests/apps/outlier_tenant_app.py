"""Tenants of a report endpoint, for tests/test_outlier_tenant.py (FastAPI + asyncpg, uvicorn).

``GET /reports``: every tenant's report is a light query and ~12 ms of awaited work; tenant
``bigco``'s also runs the audit statement nobody else runs (~180 ms in PostgreSQL, awaited: the
loop stays free). Requests with ``?export=1`` (any tenant) render an export synchronously on the
loop for 600 ms: an event-loop blocker unrelated to tenants, which sets the endpoint's p95.

``GET /reports-even``: tenants whose latency differs naturally but overlaps (their data sizes
differ a little: 10 to 22 ms plus 0 to 12 ms by ``?size=``), with the same blocker; no outlier.

The PostgreSQL DSN comes from ``OUTLIER_PG_DSN``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import asyncpg
from fastapi import FastAPI, Header

DSN = os.environ.get("OUTLIER_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
BIG_TENANT = "bigco"
AUDIT_SECONDS = 0.18
EXPORT_SECONDS = 0.6
# Each tenant's base latency on /reports-even, in ms.
EVEN_BASE_MS = {"acme": 10, "globex": 13, "initech": 16, "umbrella": 19, "bigco": 22}

LIGHT = "SELECT count(*) FROM generate_series(1, $1::int) AS item"
AUDIT = "SELECT pg_sleep($1) AS audit_trail"

pool: asyncpg.Pool | None = None


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    global pool
    pool = await asyncpg.create_pool(DSN, min_size=2, max_size=4)
    try:
        yield
    finally:
        await pool.close()


app = FastAPI(lifespan=lifespan)
Tenant = Annotated[str, Header(alias="X-Tenant")]


def render_export() -> None:
    time.sleep(EXPORT_SECONDS)  # synchronous on the loop: the unrelated blocker


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/reports")
async def reports(tenant: Tenant = "anonymous", export: int = 0) -> dict[str, Any]:
    assert pool is not None
    async with pool.acquire() as con:
        items = await con.fetchval(LIGHT, 100)
        if tenant == BIG_TENANT:
            await con.fetchval(AUDIT, AUDIT_SECONDS)  # PLANTED: only bigco's reports
    await asyncio.sleep(0.012)
    if export:
        render_export()
    return {"tenant": tenant, "items": items}


@app.get("/reports-even")
async def reports_even(
    tenant: Tenant = "anonymous", export: int = 0, size: int = 0
) -> dict[str, Any]:
    assert pool is not None
    async with pool.acquire() as con:
        items = await con.fetchval(LIGHT, 100)
    await asyncio.sleep((EVEN_BASE_MS.get(tenant, 10) + 2 * size) / 1000)
    if export:
        render_export()
    return {"tenant": tenant, "items": items}
