"""What every router of the API shares: who may call (the Host allow-list and the token), the
store (the app's :class:`~perfsleuth.server.backend.Backend`, under its lock), the error shape
(``{"error": sentence, "status": code}``), JSON replies, and the ``since`` window.

Who may call: requests must name this server in their ``Host`` header (a loopback name, the
address the connection came in on, or a name given in ``allowed_hosts``), so that a web page on
a DNS-rebinding domain cannot read the API from a browser on this machine; with a token, every
/api/ call (and OTLP payload to /v1/) must carry it.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from perfsleuth.server import console, queries
from perfsleuth.server.backend import Backend
from perfsleuth.server.models import ApiErrorBody
from perfsleuth.server.window import BadRange, Window, window
from perfsleuth.store.base import Store, StoreError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_TOKEN_CHARS = 16


# ------------------------------------------------------------------------------ errors, JSON


class ApiError(Exception):
    """Answered as ``{"error": message, "status": status, **extra}`` with that status."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


ERROR_REPLIES: dict[int | str, dict[str, Any]] = {
    400: {"model": ApiErrorBody, "description": "Bad input: the sentence says what to change."},
    401: {"model": ApiErrorBody, "description": "This server needs a token."},
    403: {"model": ApiErrorBody, "description": "Wrong token."},
    404: {"model": ApiErrorBody, "description": "No such endpoint, trace, finding or run."},
}


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, "status": status, **extra}, status_code=status)


json_value = console.json_value


def ok(body: Any) -> Response:
    """A JSON reply: times as ISO text, non-finite floats as null (see console.json_value)."""
    return Response(
        json.dumps(json_value(body), ensure_ascii=False, allow_nan=False),
        media_type="application/json",
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every error the API answers has the one shape, 400 for bad input (not FastAPI's 422)."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return error(e.status, e.message, **e.extra)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, e: RequestValidationError) -> JSONResponse:
        parts = []
        for d in e.errors():
            where = ".".join(str(x) for x in d.get("loc", ()) if x not in ("query", "body"))
            parts.append(f"{where}: {d.get('msg')}" if where else str(d.get("msg")))
        return error(400, "bad request: " + "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = e.detail if isinstance(e.detail, str) else "error"
        if e.status_code == 404:
            msg = "no such API path; see /api/openapi.json"
        return error(e.status_code, msg)


# ------------------------------------------------------------------------------ who may call


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


class Access:
    """The Host allow-list and the token of one app: :meth:`refusal` of a request."""

    def __init__(
        self,
        token: str | None,
        allowed_hosts: tuple[str, ...] | list[str],
        tokens: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        """``tokens``: token -> (name, kind), kind ``ingest`` (may only send data: POST
        /api/ingest/..., /v1/traces) or ``read`` (may only read); ``token`` may do both."""
        if token is not None and not token.strip():
            raise ValueError("the token is blank: give a token, or none for no token check")
        self.token = token
        self.tokens = dict(tokens or {})
        hosts = {host_name(h) for h in allowed_hosts if h.strip()}
        self.any_host = "*" in hosts
        hosts.update(LOOPBACK)
        self.hosts = frozenset(hosts)

    def refusal(self, request: Request) -> JSONResponse | None:
        """The error reply for a request this server must not answer, else None."""
        given_host = request.headers.get("host")
        if given_host is not None and not self.any_host:
            name = host_name(given_host)
            server = request.scope.get("server")
            own = host_name(str(server[0])) if server else None
            if name not in self.hosts and name != own:
                return error(
                    400,
                    f"this server does not answer to the host name {name[:100]!r} (a page on "
                    "another site may be reaching it through DNS rebinding); to allow it, start "
                    "the server with --allow-host NAME",
                )
        # The token guards the API and the OTLP receiver (/v1/: it writes to the store).
        path = request.url.path
        if (self.token or self.tokens) and path.startswith(("/api", "/v1/")):
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else None
            if given is None:
                given = request.query_params.get("token")
            if not given:
                return error(
                    401,
                    "this server needs a token: send 'Authorization: Bearer TOKEN' "
                    "or add ?token=TOKEN to the URL",
                )
            name_kind = self.token_of(given)
            if name_kind is None:
                return error(403, "wrong token")
            name, kind = name_kind
            writes = path.startswith(("/api/ingest/", "/v1/"))
            if kind == "ingest" and not writes:
                return error(403, f"the token {name!r} may only send data (kind ingest)")
            if kind == "read" and writes:
                return error(403, f"the token {name!r} may only read (kind read)")
            request.state.token_name = name
        return None

    def token_of(self, given: str) -> tuple[str, str] | None:
        """(name, kind) of a token this server knows, else None (every one compared)."""
        found = None
        g = given.encode()
        if self.token and hmac.compare_digest(g, self.token.encode()):
            found = ("default", "all")
        for tok, name_kind in self.tokens.items():
            if hmac.compare_digest(g, tok.encode()):
                found = name_kind
        return found


# ------------------------------------------------------------------------------ the store


@dataclass(frozen=True)
class Limits:
    """The SQL console's limits of one app (``app.state.limits``)."""

    sql_time_limit: float = console.TIME_LIMIT_S
    sql_max_bytes: int = console.MAX_BYTES


def get_backend(request: Request) -> Backend:
    be: Backend = request.app.state.backend
    return be


def get_limits(request: Request) -> Limits:
    limits: Limits = request.app.state.limits
    return limits


BackendDep = Annotated[Backend, Depends(get_backend)]
LimitsDep = Annotated[Limits, Depends(get_limits)]


def answer(be: Backend, fn: Callable[..., Any], *args: Any) -> Response:
    """``fn(store, *args)`` under the store's lock, as a JSON reply; an unknown name is a 404,
    an ambiguous id prefix or a store's refusal a 400."""
    try:
        with be.use() as store:
            return ok(fn(store, *args))
    except queries.NotFound as e:
        raise ApiError(404, str(e)) from e
    except queries.Ambiguous as e:
        raise ApiError(400, str(e), candidates=e.candidates) from e
    except StoreError as e:
        raise ApiError(400, str(e).splitlines()[0]) from e


def resolve_trace(store: Store, trace_id: str) -> str:
    """The full id of a trace id or unique prefix; ApiError 404 or 400 (ambiguous)."""
    try:
        return queries.resolve_trace(store, trace_id)
    except queries.NotFound as e:
        raise ApiError(404, str(e)) from e
    except queries.Ambiguous as e:
        raise ApiError(400, str(e), candidates=e.candidates) from e


# ------------------------------------------------------------------------------ parameters


SinceQ = Annotated[
    str | None,
    Query(description="Window looking back from now: 15m, 1h, 24h, 7d, or all (default 1h)."),
]


HostQ = Annotated[
    str | None,
    Query(description="Only the requests of this host (the fleet filter; empty: those with none)."),
]
ServiceQ = Annotated[
    str | None,
    Query(description="Only the requests of this service (the fleet filter)."),
]


def window_of(since: str | None, host: str | None = None, service: str | None = None) -> Window:
    try:
        return window(since, host, service)
    except BadRange as e:
        raise ApiError(400, str(e)) from e
