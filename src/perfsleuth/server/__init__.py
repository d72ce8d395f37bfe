"""The web UI server (``perfsleuth ui``): see :mod:`perfsleuth.server.app`. The app (FastAPI)
is imported when first asked for, so that ``perfsleuth.server.console`` (used by the CLI's
``sql``) comes without it."""

from __future__ import annotations

from typing import Any

__all__ = [
    "LOOPBACK",
    "MIN_TOKEN_CHARS",
    "Backend",
    "check_token",
    "create_app",
    "serve",
    "url_for",
]


def __getattr__(name: str) -> Any:
    if name in ("LOOPBACK", "MIN_TOKEN_CHARS", "Backend", "check_token", "create_app"):
        from perfsleuth.server import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def url_for(host: str, port: int, token: str | None = None, tls: bool = False) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    scheme = "https" if tls else "http"
    return f"{scheme}://{shown}:{port}/" + (f"?token={token}" if token else "")


def serve(
    data_dir: str,
    host: str = "127.0.0.1",
    port: int = 8321,
    token: str | None = None,
    on_ready: object = None,
    ingest: bool = True,
    allowed_hosts: tuple[str, ...] | list[str] = (),
    tokens: dict[str, tuple[str, str]] | None = None,
    ingest_every: float | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> None:
    """Serve until interrupted (Ctrl-C). ``on_ready(port)`` is called once listening. Without
    ``ingest`` the store is opened read-only; ``ingest_every``: seconds between spool ingests
    (3 by default). ``tokens``: token -> (name, kind) of ``perfsleuth server --tokens``. A
    token shorter than MIN_TOKEN_CHARS is refused (ValueError); ``allowed_hosts``: Host names
    answered besides loopback and ``host``. ``tls_cert`` / ``tls_key``: PEM files; with them
    the port speaks HTTPS only."""
    import uvicorn

    from perfsleuth.server.app import check_token, create_app

    check_token(token)
    own = [host] if host not in ("0.0.0.0", "::", "") else []
    every = (3.0 if ingest_every is None else ingest_every) if ingest else 0
    app = create_app(
        data_dir,
        token=token,
        tokens=tokens or {},
        ingest_every=every,
        allowed_hosts=[*allowed_hosts, *own],
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )
    server = uvicorn.Server(config)
    if callable(on_ready):
        orig = server.startup

        async def startup(sockets: object = None) -> None:
            await orig(sockets=sockets)  # type: ignore[arg-type]
            if server.started:
                # The port listened on (the OS's choice for --port 0).
                socks = [sk for srv in getattr(server, "servers", []) for sk in srv.sockets]
                on_ready(int(socks[0].getsockname()[1]) if socks else port)

        server.startup = startup  # type: ignore[method-assign]
    server.run()
