"""The web UI's server: a JSON API under /api/ (OpenAPI at /api/openapi.json) and the built UI
(static files from ``perfsleuth/server/static``, made by ``scripts/setup.sh``).

DuckDB allows one writing process per database, and a connection is not meant for concurrent
use, so the server holds one store, guarded by a lock: API calls and the background ingest
(every ``ingest_every`` seconds) take turns. SQL console statements run on cursors of their own
(DuckDB connections to the same database, see :mod:`perfsleuth.server.console`), at most
CONSOLE_SLOTS at a time, so that the rest of the API answers while one runs.

Who may call: requests must name this server in their ``Host`` header (a loopback name, the
address the connection came in on, or a name given in ``allowed_hosts``), so that a web page on
a DNS-rebinding domain cannot read the API from a browser on this machine; with a token, every
/api/ call (and OTLP payload to /v1/) must carry it.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from perfsleuth.server import console, queries
from perfsleuth.server.window import BadRange, Window, window
from perfsleuth.store.base import Store, StoreError, open_store

log = logging.getLogger("perfsleuth.server")

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
SQL_MAX_ROWS = console.MAX_ROWS
SQL_MAX_BYTES = console.MAX_BYTES
SQL_TIME_LIMIT_S = console.TIME_LIMIT_S
CONSOLE_SLOTS = 2  # console statements running at once; more are refused (429)
FINDINGS_TTL_S = 30.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_TOKEN_CHARS = 16


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


def host_name(header: str) -> str:
    """The host name of a ``Host`` header, lower case, without port or brackets."""
    h = header.strip().lower()
    if h.startswith("["):
        h = h[1 : h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def check_token(token: str | None) -> None:
    """ValueError unless ``token`` is None or long enough to resist guessing."""
    if token is not None and len(token.strip()) < MIN_TOKEN_CHARS:
        what = "blank" if not token.strip() else f"{len(token.strip())} characters"
        raise ValueError(
            f"the token is too short ({what}): use at least {MIN_TOKEN_CHARS} random "
            "characters, e.g. from `python -c 'import secrets; print(secrets.token_urlsafe())'`"
        )


class Backend:
    """The one store of the server process, its lock, and the background ingest."""

    def __init__(self, data_dir: str, ingest_every: float = 3.0) -> None:
        """``ingest_every`` <= 0: no ingest, and the store is opened read-only, so that CLI
        commands on the same data can run beside the server (DuckDB lets many processes read
        a file, or one write it)."""
        self.data_dir = os.path.abspath(data_dir)
        self.store: Store = open_store(self.data_dir, read_only=ingest_every <= 0)
        # The SQL console must not read or write files of the machine (read_csv, COPY, ...):
        # nothing else of the server needs external access, and it cannot be switched back on.
        con = getattr(self.store, "_con", None)
        self._console_con = None
        self._temp_views: list[str] = []
        if con is not None:
            console.sandbox(con)
            # The console's cursors come from this one (made before any other thread runs).
            self._console_con = con.cursor()
            # A read-only store's views are temporary, seen by its own connection only: the
            # console's cursors make them again.
            self._temp_views = console.temp_views(con)
        self._console_lock = threading.Lock()
        self.console_slots = threading.BoundedSemaphore(CONSOLE_SLOTS)
        self.console_running = 0
        self.lock = threading.Lock()
        self.ingest_every = ingest_every
        self.last_ingest: dict[str, Any] = {"at": None, "requests": 0, "error": None}
        self._stop = threading.Event()
        self._findings: dict[tuple[str, str | None], tuple[float, list[Any]]] = {}
        self._thread: threading.Thread | None = None

    @contextmanager
    def use(self) -> Iterator[Store]:
        with self.lock:
            yield self.store

    def findings(self, store: Store, w: Window, endpoint: str | None = None) -> list[Any]:
        """The detectors' findings, kept for FINDINGS_TTL_S: they cost seconds over millions of
        requests, and every page refresh and every "evidence" click asks again."""
        from perfsleuth.analysis import find

        key = (w.label, endpoint)
        hit = self._findings.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        found = find(store, since=w.since, endpoint=endpoint)
        if len(self._findings) > 64:
            self._findings.clear()
        self._findings[key] = (now + FINDINGS_TTL_S, found)
        return found

    def ingest_once(self) -> None:
        try:
            with self.lock:
                report = self.store.ingest()
            self.last_ingest = {
                "at": time.time(),
                "requests": report.requests,
                "error": None,
            }
        except Exception as e:  # keep serving what is there; say why ingest failed
            log.warning("ingest failed: %s", e)
            self.last_ingest = {"at": time.time(), "requests": 0, "error": str(e)}

    def start(self) -> None:
        if self.ingest_every <= 0 or self._thread is not None:
            return

        def loop() -> None:
            # The first round may be a long backlog: the server listens meanwhile (calls wait
            # for the lock, then see it all).
            while True:
                self.ingest_once()
                if self._stop.wait(self.ingest_every):
                    return

        self._thread = threading.Thread(target=loop, name="perfsleuth-ingest", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self.lock:
            with self._console_lock:
                if self._console_con is not None:
                    self._console_con.close()
                    self._console_con = None
            self.store.close()

    def console(self, query: str, limit: int, max_bytes: int, time_limit: float) -> console.Result:
        """Run a console statement on a cursor of its own (no store lock: the rest of the API
        answers meanwhile); ConsoleError when refused, failed, too long or too many at once."""
        if not self.console_slots.acquire(blocking=False):
            raise ApiError(
                429, f"{CONSOLE_SLOTS} SQL console queries are running: try again when one ends"
            )
        try:
            with self._console_lock:
                if self._console_con is None:
                    raise console.ConsoleError("the server is shutting down")
                cur = self._console_con.cursor()
                self.console_running += 1

            try:
                return console.run(
                    cur,
                    query,
                    limit=limit,
                    max_bytes=max_bytes,
                    time_limit=time_limit,
                    prepare=console.make_views(self._temp_views),
                )
            finally:
                with self._console_lock:
                    self.console_running -= 1
        finally:
            self.console_slots.release()


_json_value = console.json_value


def _ok(body: Any) -> Response:
    return Response(
        json.dumps(_json_value(body), ensure_ascii=False, allow_nan=False),
        media_type="application/json",
    )


def _err(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, "status": status, **extra}, status_code=status)


CURL_INLINE_CHARS = 100_000  # longer commands (big bodies) are fetched when copied


def _curl(capture: dict[str, Any], to_url: str | None = None) -> tuple[str, str | None]:
    """(curl command, why it is not an exact replay or None). A truncated body is kept in
    the command, with the reason next to it. Without ``to_url`` the command sends the request
    to $PERFSLEUTH_TARGET, never to the host the captured Host header names."""
    from perfsleuth.analysis import replay

    try:
        return replay.curl_for(capture, to_url), None
    except replay.ReplayError as e:
        if to_url and not capture.get("body_truncated"):
            raise ApiError(400, str(e)) from e
        return replay.curl_for(capture, to_url, allow_truncated=True), str(e)


def _replay(store: Store, trace_id: str) -> dict[str, Any] | None:
    cap = store.capture(trace_id)
    if cap is None:
        return None
    curl, note = _curl(cap)
    inline = len(curl) <= CURL_INLINE_CHARS
    return {
        "reason": cap.get("reason"),
        "method": cap.get("method"),
        "url": cap.get("url"),
        "body_size": cap.get("body_size"),
        "body_truncated": cap.get("body_truncated"),
        "redacted": cap.get("redacted") or [],
        "note": note,
        "curl": curl if inline else curl[:2000] + "\n# ... (copy for the whole command)",
        "complete": inline,
    }


def _window(since: str | None) -> Window:
    try:
        return window(since)
    except BadRange as e:
        raise ApiError(400, str(e)) from e


SinceQ = Annotated[
    str | None,
    Query(description="Window looking back from now: 15m, 1h, 24h, 7d, or all (default 1h)."),
]


def _trace_id(store: Store, trace_id: str) -> str:
    try:
        return queries.resolve_trace(store, trace_id)
    except queries.NotFound as e:
        raise ApiError(404, str(e)) from e
    except queries.Ambiguous as e:
        raise ApiError(400, str(e), candidates=e.candidates) from e


def create_app(
    data_dir: str,
    *,
    token: str | None = None,
    ingest_every: float = 3.0,
    sql_time_limit: float = SQL_TIME_LIMIT_S,
    sql_max_bytes: int = SQL_MAX_BYTES,
    allowed_hosts: tuple[str, ...] | list[str] = (),
    backend: Backend | None = None,
) -> FastAPI:
    """The ASGI app. ``token``: when set, every /api/ call must carry it (``Authorization:
    Bearer TOKEN`` or ``?token=TOKEN``); a blank token is refused (ValueError). Requests must
    name a loopback name, the address they came in on, or one of ``allowed_hosts`` in their
    Host header ("*" allows any). Ingest starts with the app and stops with it."""
    if token is not None and not token.strip():
        raise ValueError("the token is blank: give a token, or none for no token check")
    hosts = {host_name(h) for h in allowed_hosts if h.strip()}
    any_host = "*" in hosts
    hosts.update(LOOPBACK)
    be = backend or Backend(data_dir, ingest_every)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
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

    @app.middleware("http")
    async def check_access(request: Request, call_next: Any) -> Any:
        given_host = request.headers.get("host")
        if given_host is not None and not any_host:
            name = host_name(given_host)
            server = request.scope.get("server")
            own = host_name(str(server[0])) if server else None
            if name not in hosts and name != own:
                return _err(
                    400,
                    f"this server does not answer to the host name {name[:100]!r} (a page on "
                    "another site may be reaching it through DNS rebinding); to allow it, start "
                    "the server with --allow-host NAME",
                )
        # The token guards the API and the OTLP receiver (/v1/: it writes to the store).
        if token and request.url.path.startswith(("/api", "/v1/")):
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else None
            if given is None:
                given = request.query_params.get("token")
            if not given:
                return _err(
                    401,
                    "this server needs a token: send 'Authorization: Bearer TOKEN' "
                    "or add ?token=TOKEN to the URL",
                )
            if not hmac.compare_digest(given.encode(), token.encode()):
                return _err(403, "wrong token")
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return _err(e.status, e.message, **e.extra)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, e: RequestValidationError) -> JSONResponse:
        parts = []
        for d in e.errors():
            where = ".".join(str(x) for x in d.get("loc", ()) if x not in ("query", "body"))
            parts.append(f"{where}: {d.get('msg')}" if where else str(d.get("msg")))
        return _err(400, "bad request: " + "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = e.detail if isinstance(e.detail, str) else "error"
        if e.status_code == 404:
            msg = "no such API path; see /api/openapi.json"
        return _err(e.status_code, msg)

    def run(fn: Any, *args: Any, **kwargs: Any) -> Response:
        try:
            with be.use() as store:
                return _ok(fn(store, *args, **kwargs))
        except queries.NotFound as e:
            raise ApiError(404, str(e)) from e
        except queries.Ambiguous as e:
            raise ApiError(400, str(e), candidates=e.candidates) from e
        except StoreError as e:
            raise ApiError(400, str(e).splitlines()[0]) from e

    @app.get("/api/status", summary="Server and data status")
    def status() -> Response:
        def body(store: Store) -> dict[str, Any]:
            first, last = queries.data_span(store)
            return {
                "data": be.data_dir,
                "first": first,
                "last": last,
                "endpoints": len(store.endpoints()),
                "ingest": be.last_ingest,
                "ingest_every_s": be.ingest_every,
                "drops": store.agent_drops(),
            }

        return run(body)

    @app.get("/api/overview", summary="Endpoint table, P95 per endpoint, slow counts, throughput")
    def overview(since: SinceQ = "1h") -> Response:
        return run(queries.overview, _window(since))

    @app.get("/api/endpoints", summary="The endpoint table (store.top) with time share")
    def endpoints(since: SinceQ = "1h") -> Response:
        return run(queries.endpoint_table, _window(since))

    @app.get("/api/endpoint", summary="One endpoint: percentiles, histogram, calls, traces")
    def endpoint(
        name: Annotated[str, Query(description='The endpoint, e.g. "GET /orders/{id}".')],
        since: SinceQ = "1h",
    ) -> Response:
        return run(queries.endpoint_detail, _window(since), name)

    @app.get("/api/calltree", summary="The call-site trie of an endpoint's calls of one kind")
    def calltree_(
        endpoint: Annotated[str, Query(description="The endpoint.")],
        kind: Annotated[str, Query(pattern="^(db|http|cache)$")] = "db",
        since: SinceQ = "1h",
        min_share: Annotated[float, Query(ge=0, le=1)] = 0.01,
    ) -> Response:
        from perfsleuth.analysis import calltree

        w = _window(since)

        def body(store: Store) -> dict[str, Any]:
            queries.check_endpoint(store, endpoint)
            tree = calltree.build(store, endpoint, kind=kind, since=w.since, min_share=min_share)
            return tree.to_dict()

        return run(body)

    @app.get("/api/profile", summary="Stack samples of an endpoint's slow requests, merged")
    def profile_(
        endpoint: Annotated[str, Query(description="The endpoint.")],
        since: SinceQ = "1h",
    ) -> Response:
        from perfsleuth.analysis import profile

        w = _window(since)

        def body(store: Store) -> dict[str, Any]:
            queries.check_endpoint(store, endpoint)
            p = profile.load(store, endpoint, since=w.since)
            return {
                "endpoint": endpoint,
                "requests": p.requests,
                "samples": p.samples,
                "states": p.states,
                "top": p.top(15),
                "tree": p.tree(),
            }

        return run(body)

    @app.get("/api/traces", summary="Requests, newest first or the slowest N")
    def traces(
        endpoint: str | None = None,
        since: SinceQ = "1h",
        slowest: Annotated[int | None, Query(ge=1, le=1000)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    ) -> Response:
        w = _window(since)

        def body(store: Store) -> list[dict[str, Any]]:
            if endpoint is not None:
                queries.check_endpoint(store, endpoint)
            return store.traces(endpoint=endpoint, since=w.since, slowest=slowest, limit=limit)

        return run(body)

    @app.get("/api/traces/{trace_id}", summary="One request: calls, attributes, samples")
    def trace(trace_id: str) -> Response:
        def body(store: Store) -> dict[str, Any]:
            try:
                t = store.trace(_trace_id(store, trace_id))
            except StoreError as e:
                raise queries.NotFound(str(e)) from e
            from perfsleuth.analysis import profile

            tid = t["trace_id"]
            t["stack_samples"] = store.samples(tid) if t.get("samples") else []
            # The same samples merged by function: the request's own flame graph.
            t["profile"] = (
                profile.load(store, t["endpoint"], trace_id=tid).tree()
                if t["stack_samples"]
                else None
            )
            t["blocker_events"] = store.blockers(trace_id=tid) if t.get("blockers") else []
            t["replay"] = _replay(store, tid)
            return t

        return run(body)

    @app.get(
        "/api/traces/{trace_id}/curl",
        summary="The captured request as a curl command (text)",
        response_class=PlainTextResponse,
    )
    def trace_curl(
        trace_id: str,
        to: Annotated[
            str | None,
            Query(
                description="The server to send it to, e.g. http://127.0.0.1:8000 (default: "
                "$PERFSLEUTH_TARGET when the command runs)."
            ),
        ] = None,
    ) -> Response:
        with be.use() as store:
            try:
                cap = store.capture(_trace_id(store, trace_id))
            except StoreError as e:
                raise ApiError(404, str(e)) from e
        if cap is None:
            raise ApiError(404, f"trace {trace_id} was not captured (no replayable request)")
        return PlainTextResponse(_curl(cap, to or None)[0] + "\n")

    @app.get("/api/findings", summary="Findings, highest impact first")
    def findings(endpoint: str | None = None, since: SinceQ = "1h") -> Response:

        w = _window(since)

        def body(store: Store) -> list[dict[str, Any]]:
            if endpoint is not None:
                queries.check_endpoint(store, endpoint)
            return [f.to_dict() for f in be.findings(store, w, endpoint)]

        return run(body)

    @app.get("/api/findings/{finding_id}", summary="One finding with its evidence")
    def finding(finding_id: str, since: SinceQ = "1h") -> Response:
        from perfsleuth.analysis import loops

        w = _window(since)

        def body(store: Store) -> dict[str, Any]:
            want = finding_id.strip().lower()
            found = be.findings(store, w)
            matches = [f for f in found if want and f.id.startswith(want)]
            if not matches:
                raise queries.NotFound(f"no finding with id {finding_id!r} in this window")
            if len(matches) > 1:
                raise ApiError(
                    400,
                    f"finding id prefix {finding_id!r} is ambiguous: it matches "
                    f"{len(matches)} findings",
                    candidates=sorted(f.id for f in matches)[:10],
                )
            f = matches[0]
            site = f.callsite or {}
            code = loops.source_line(site.get("file"), site.get("line")) if site else None
            return {**f.to_dict(), "source_line": code}

        return run(body)

    @app.post(
        "/api/sql",
        summary="One read-only SQL statement, with a row cap, a byte cap and a time limit",
    )
    def sql(
        query: Annotated[str, Body(embed=True, description="SELECT or EXPLAIN of one.")],
        limit: Annotated[int, Body(embed=True, ge=1, le=SQL_MAX_ROWS)] = 1000,
    ) -> Response:
        if not query.strip():
            raise ApiError(400, "the query is empty")
        try:
            res = be.console(query, limit, sql_max_bytes, sql_time_limit)
        except console.ConsoleError as e:
            raise ApiError(400, str(e)) from e
        head = json.dumps(
            {
                "columns": _json_value(res.columns),
                "truncated": res.truncated,
                "truncated_by": res.truncated_by,
                "limit": limit,
                "max_bytes": sql_max_bytes,
                "bytes": res.bytes,
                "elapsed_ms": res.elapsed_ms,
            },
            ensure_ascii=False,
        )
        # The rows were encoded one by one within the time limit; they are joined, not re-encoded.
        return Response(
            head[:-1] + ', "rows": [' + ",".join(res.encoded) + "]}",
            media_type="application/json",
        )

    from perfsleuth.server.compare import router as compare_router

    app.include_router(compare_router)

    from perfsleuth.server.startup import router as runs_router

    app.include_router(runs_router)

    from perfsleuth.server.otlp import router as otlp_router

    app.include_router(otlp_router)

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

    return app
