"""The perfsleuth agent: runs inside the monitored application. Stdlib only; never raises.

import perfsleuth.agent as ps
ps.start()                 # or run the app under `perfsleuth run -- CMD`
app = ps.asgi(app)         # / ps.wsgi(app) / the Django middleware
ps.attr("rows_loaded", n)  # custom attribute on the current request
ps.keep_capture()          # keep a replayable capture of the current request
with ps.task("sync-avatars"): ...   # background work, recorded as kind "background"
"""

from __future__ import annotations

import _thread

TYPE_CHECKING = False  # typing itself is not imported here: it costs milliseconds
if TYPE_CHECKING:
    from typing import Any

    from perfsleuth.agent.capture import keep_capture
    from perfsleuth.agent.recorder import attr, current, set_user, tag, task

__all__ = [
    "DjangoMiddleware",
    "asgi",
    "attr",
    "current",
    "flush",
    "keep_capture",
    "set_user",
    "start",
    "started",
    "stats",
    "tag",
    "task",
    "wsgi",
]

_started = False
_start_lock = _thread.allocate_lock()


def start(
    data_dir: str | None = None,
    *,
    service: str | None = None,
    instrument: bool = True,
    **overrides: Any,
) -> bool:
    """Start recording in this process (idempotent). Returns whether the agent is running.

    ``instrument`` patches supported libraries (DB drivers, HTTP clients, caches, frameworks)
    now if imported, or when they are imported later.
    """
    global _started
    try:
        with _start_lock:
            if _started:
                return True
            from perfsleuth.agent import config, shipper

            cfg = config.load(data_dir=data_dir, service=service, **overrides)
            if cfg.disabled:
                return False
            shipper.start(cfg)
            from perfsleuth.agent import evidence  # after shipper: its atexit flush runs first

            evidence.start(cfg)
            from perfsleuth.agent import heap

            heap.install(cfg)  # SIGUSR2 -> heap histogram, when the app does not use it
            if instrument:
                from perfsleuth.agent import instrument as _instrument

                _instrument.install()
            else:  # no import hooks: multiprocessing's children are hooked now
                import multiprocessing.util

                shipper.hook_multiprocessing(multiprocessing.util)
            _started = True
            return True
    except Exception:
        return False


def started() -> bool:
    return _started


def flush(timeout: float = 5.0) -> None:
    """Write all finished requests to the spool now."""
    try:
        from perfsleuth.agent import evidence, shipper

        evidence.flush()
        shipper.flush(timeout)
    except Exception:
        pass


def stats() -> dict[str, int]:
    """The agent's counters in this process (recorded, written, dropped by reason, errors)."""
    from perfsleuth.agent import recorder

    return dict(recorder.stats)


def asgi(app: Any) -> Any:
    """Wrap an ASGI application (Starlette, FastAPI, Django ASGI, ...)."""
    try:
        from perfsleuth.agent.frameworks.asgi import PerfsleuthASGI

        return PerfsleuthASGI(app)
    except Exception:
        return app


def wsgi(app: Any) -> Any:
    """Wrap a WSGI application (Flask, Django WSGI, ...)."""
    try:
        from perfsleuth.agent.frameworks.wsgi import PerfsleuthWSGI

        return PerfsleuthWSGI(app)
    except Exception:
        return app


# Imported on first use: ``import perfsleuth.agent`` (by a launcher, before the app) stays
# cheap, and what the app never calls is never imported.
_LAZY = {
    "attr": "perfsleuth.agent.recorder",
    "current": "perfsleuth.agent.recorder",
    "set_user": "perfsleuth.agent.recorder",
    "tag": "perfsleuth.agent.recorder",
    "task": "perfsleuth.agent.recorder",
    "keep_capture": "perfsleuth.agent.capture",
}


def __getattr__(name: str) -> Any:
    if name == "DjangoMiddleware":  # imported lazily: importing Django is not free
        from perfsleuth.agent.frameworks.django import PerfsleuthMiddleware

        return PerfsleuthMiddleware
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(name)
    import importlib

    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value
