"""The API's routers, one module per area; :func:`perfsleuth.server.app.create_app` includes
them in this order (the order of the OpenAPI schema and of /api/docs)."""

from __future__ import annotations

from fastapi import APIRouter

from perfsleuth.server.routes import (
    captures,
    compare,
    evidence,
    findings,
    fleet,
    overview,
    runs,
    sql,
    status,
    traces,
)

ROUTERS: tuple[APIRouter, ...] = (
    status.router,
    fleet.router,
    overview.router,
    evidence.router,
    traces.router,
    captures.router,
    findings.router,
    sql.router,
    compare.router,
    runs.router,
)
