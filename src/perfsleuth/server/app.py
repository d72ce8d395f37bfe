"""The web UI's server: a JSON API under /api/ (OpenAPI at /api/openapi.json) and the built UI
(static files from ``perfsleuth/server/static``, made by ``scripts/setup.sh``).

:func:`create_app` puts the parts together: the access check (:class:`deps.Access`: Host
allow-list and token) as a middleware, the one error shape, the routers of
:mod:`perfsleuth.server.routes` and the OTLP receiver, a 404 for other /api/ paths, and the UI.
The store and its lock, ingest and the console live in :class:`backend.Backend`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from perfsleuth.server import console
from perfsleuth.server.backend import Backend
from perfsleuth.server.deps import (
    ERROR_REPLIES,
    LOOPBACK,
    MIN_TOKEN_CHARS,
    Access,
    ApiError,
    Limits,
    check_token,
    host_name,
    install_error_handlers,
)

__all__ = [
    "LOOPBACK",
    "MIN_TOKEN_CHARS",
    "STATIC_DIR",
    "Backend",
    "check_token",
    "create_app",
    "host_name",
]

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
SQL_MAX_BYTES = console.MAX_BYTES
SQL_TIME_LIMIT_S = console.TIME_LIMIT_S


def create_app(
    data_dir: str,
    *,
    token: str | None = None,
    ingest_every: float = 3.0,
    sql_time_limit: float = SQL_TIME_LIMIT_S,
    sql_max_bytes: int = SQL_MAX_BYTES,
    allowed_hosts: tuple[str, ...] | list[str] = (),
    backend: Backend | None = None,
    tokens: dict[str, tuple[str, str]] | None = None,
) -> FastAPI:
    """The ASGI app. ``token``: when set, every /api/ call must carry it (``Authorization:
    Bearer TOKEN`` or ``?token=TOKEN``); a blank token is refused (ValueError). Requests must
    name a loopback name, the address they came in on, or one of ``allowed_hosts`` in their
    Host header ("*" allows any). Ingest starts with the app and stops with it."""
    from perfsleuth.server.otlp import router as otlp_router
    from perfsleuth.server.routes import ROUTERS
    from perfsleuth.server.routes.ingest import router as ingest_router

    access = Access(token, allowed_hosts, tokens)
    be = backend or Backend(data_dir, ingest_every)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        be.start()
        try:
            yield
        finally:
            be.close()

    app = FastAPI(
        title="perfsleuth",
        description="The perfsleuth web UI's API: endpoints, traces, findings, read-only SQL.",
        openapi_url="/api/openapi.json",
        docs_url="/api/docs",
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.backend = be
    app.state.limits = Limits(sql_time_limit=sql_time_limit, sql_max_bytes=sql_max_bytes)

    app.add_middleware(AccessGate, access=access)

    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router, responses=ERROR_REPLIES)
    app.include_router(otlp_router)
    app.include_router(ingest_router, responses=ERROR_REPLIES)

    @app.api_route("/api/{rest:path}", methods=["GET", "POST"], include_in_schema=False)
    def unknown(rest: str) -> Response:
        raise ApiError(404, f"no such API path /api/{rest}; see /api/openapi.json")

    if os.path.isfile(os.path.join(STATIC_DIR, "index.html")):
        app.mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="ui")
    else:

        @app.get("/", include_in_schema=False)
        def not_built() -> HTMLResponse:
            return HTMLResponse(
                "<h1>perfsleuth</h1><p>The web UI is not built: run <code>bash scripts/"
                "setup.sh</code> (it runs <code>npm ci &amp;&amp; npm run build</code> in "
                "<code>web/</code>). The API is at <a href='/api/docs'>/api/docs</a>.</p>"
            )

    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app


class AccessGate:
    """Refuses what :class:`Access` refuses, before the app sees the request. A plain ASGI
    middleware: Starlette's ``@app.middleware("http")`` passes the body through a task group
    and memory streams: ~0.35 ms of CPU a request, an empty OTLP POST 1.02 -> 0.67 ms."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.access.refusal(Request(scope))
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422 replies: bad input is answered 400 in the API's one
    error shape (ApiErrorBody)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        for ops in spec.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        schemas = spec.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = spec
    return app.openapi_schema
