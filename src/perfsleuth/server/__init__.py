"""The web UI server (``perfsleuth ui``): see :mod:`perfsleuth.server.app`."""

from __future__ import annotations

from perfsleuth.server.app import LOOPBACK, Backend, create_app

__all__ = ["LOOPBACK", "Backend", "create_app", "serve", "url_for"]


def url_for(host: str, port: int, token: str | None = None) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def serve(
    data_dir: str,
    host: str = "127.0.0.1",
    port: int = 8321,
    token: str | None = None,
    on_ready: object = None,
    ingest: bool = True,
) -> None:
    """Serve until interrupted (Ctrl-C). ``on_ready(port)`` is called once listening. Without
    ``ingest`` the store is opened read-only."""
    import uvicorn

    app = create_app(data_dir, token=token, ingest_every=3.0 if ingest else 0)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    if callable(on_ready):
        orig = server.startup

        async def startup(sockets: object = None) -> None:
            await orig(sockets=sockets)  # type: ignore[arg-type]
            if server.started:
                on_ready(port)

        server.startup = startup  # type: ignore[method-assign]
    server.run()
