"""SQLAlchemy: connection-pool checkout waits (statements are recorded by the driver patches).

SQLAlchemy executes every statement through the DB-API driver, which perfsleuth already
instruments (:mod:`perfsleuth.agent.instrument.dbapi`, :mod:`.asyncpg`), so nothing is
recorded at the ``Engine``/``Session`` level: each statement appears exactly once, with the
driver's view of it (the SQL actually sent).

What only SQLAlchemy knows is how long a request waited to *get* a connection.
``Pool.connect`` (and ``SingletonThreadPool.connect``, which overrides it) is timed; the
checkout covers waiting for a free connection of an exhausted pool, opening a new DB-API
connection when the pool grows, and ``pool_pre_ping``. When a checkout inside a request
takes at least :data:`MIN_WAIT_NS` (1 ms) -- or fails, e.g. the pool's ``TimeoutError`` --
it is recorded as its own call::

    kind "db", system from the dialect ("postgresql", "sqlite", "mysql"),
    target "CONNECT", wait = duration = checkout time in ns, error = exception class name.

A separate call was chosen over adding the wait to the request's next statement: it keeps
statement durations honest, shows the wait where it happened (its own call site and
offset), also covers checkouts that are never followed by a statement, and costs nothing on
the statement hot path. Fast checkouts from a healthy pool (tens of microseconds) are not
recorded, so they do not inflate every request's call count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from perfsleuth.agent import recorder
from perfsleuth.agent.instrument import _patch

MIN_WAIT_NS = 1_000_000
TARGET = "CONNECT"

_perf = time.perf_counter_ns
_current = recorder.current
_SYSTEMS = {"postgresql": "postgresql", "sqlite": "sqlite", "mysql": "mysql", "mariadb": "mysql"}


def _system(pool: Any) -> str:
    try:
        name = str(getattr(getattr(pool, "_dialect", None), "name", "") or "")
    except Exception:
        name = ""
    return _SYSTEMS.get(name, name or "sql")


def _record(pool: Any, t0: int, t1: int, error: str | None) -> None:
    try:
        call = recorder.start_call("db", _system(pool), TARGET)
        if call is None:
            return
        call.start = t0
        call.end = t1
        call.wait = t1 - t0
        call.error = error
    except Exception:
        recorder.internal_error()


def _wrap_connect(orig: Callable[..., Any]) -> Callable[..., Any]:
    def connect(self: Any) -> Any:
        if _current() is None:
            return orig(self)
        t0 = _perf()
        try:
            conn = orig(self)
        except BaseException as exc:
            _record(self, t0, _perf(), type(exc).__name__)
            raise
        t1 = _perf()
        if t1 - t0 >= MIN_WAIT_NS:
            _record(self, t0, t1, None)
        return conn

    return _patch.mark(connect, orig)


def _pool_classes(base: type) -> list[type]:
    out = [base]
    todo: list[type] = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in out:
            out.append(cls)
            todo.extend(cls.__subclasses__())
    return out


def patch(module: ModuleType) -> None:
    import sqlalchemy.pool  # noqa: F401 - loads the pool implementations
    from sqlalchemy.pool.base import Pool

    for cls in _pool_classes(Pool):
        _patch.patch(cls, "connect", _wrap_connect)
