"""asyncpg: ``Connection.execute/executemany/fetch/fetchrow/fetchval/fetchmany`` and the same
methods of ``PreparedStatement`` are replaced on the classes (pure Python coroutines).

asyncpg's pool proxies look methods up on the connection class at call time, so pooled
connections are covered too. The methods do not call each other (they share private
helpers), so every statement is recorded once. Rows: ``len(result)`` for ``fetch`` /
``fetchmany``, 0 or 1 for ``fetchrow``, 1 for a non-NULL ``fetchval``, the count in the
status string (``"INSERT 0 3"``) for ``execute``. ``executemany``/``fetchmany`` set
``extra={"many": n}``. asyncpg's own housekeeping statements (``ROLLBACK`` / reset queries
on release, transaction ``BEGIN``/``COMMIT``) run through ``execute`` too and are recorded
when they happen inside a request: they are real round trips.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from perfsleuth.agent import recorder
from perfsleuth.agent.instrument import _patch
from perfsleuth.agent.instrument.dbcall import finish_many, many_args, sql_text

_start_call = recorder.start_call
_internal_error = recorder.internal_error


def _status_rows(status: Any) -> int | None:
    if type(status) is str:
        tail = status.rpartition(" ")[2]
        if tail.isdigit():
            return int(tail)
    return None


def _rows(how: str, result: Any) -> int | None:
    if how == "list":
        return len(result)
    if how == "row":
        return 0 if result is None else 1
    if how == "val":
        return None if result is None else 1
    if how == "status":
        return _status_rows(result)
    return None


def _wrap_conn(orig: Callable[..., Any], how: str) -> Callable[..., Any]:
    """``method(self, query, *args, **kwargs)``: args are the statement's parameters."""

    async def method(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start_call(
            "db", "postgresql", query if type(query) is str else sql_text(query), args or None
        )
        if call is None:
            return await orig(self, query, *args, **kwargs)
        try:
            result = await orig(self, query, *args, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            call.finish()
            raise
        call.finish()
        try:
            call.rows = _rows(how, result)
        except Exception:
            _internal_error()
        return result

    return _patch.mark(method, orig)


def _wrap_conn_many(orig: Callable[..., Any], how: str) -> Callable[..., Any]:
    """``method(self, query, args, **kwargs)``: args is a sequence of parameter tuples."""

    async def method(self: Any, query: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        passed, hashed, n = many_args(args)
        call = _start_call(
            "db", "postgresql", query if type(query) is str else sql_text(query), hashed
        )
        if call is None:
            return await orig(self, query, args, *rest, **kwargs)
        try:
            result = await orig(self, query, passed, *rest, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            finish_many(call, n, passed)
            call.finish()
            raise
        call.finish()
        try:
            finish_many(call, n, passed)
            call.rows = _rows(how, result)
        except Exception:
            _internal_error()
        return result

    return _patch.mark(method, orig)


def _stmt_query(stmt: Any) -> str:
    q = getattr(stmt, "_query", None)
    return q if type(q) is str else sql_text(q)


def _wrap_stmt(orig: Callable[..., Any], how: str) -> Callable[..., Any]:
    """``PreparedStatement.method(self, *args, **kwargs)``."""

    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start_call("db", "postgresql", _stmt_query(self), args or None)
        if call is None:
            return await orig(self, *args, **kwargs)
        try:
            result = await orig(self, *args, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            call.finish()
            raise
        call.finish()
        try:
            call.rows = _rows(how, result)
        except Exception:
            _internal_error()
        return result

    return _patch.mark(method, orig)


def _wrap_stmt_many(orig: Callable[..., Any], how: str) -> Callable[..., Any]:
    """``PreparedStatement.method(self, args, **kwargs)``."""

    async def method(self: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        passed, hashed, n = many_args(args)
        call = _start_call("db", "postgresql", _stmt_query(self), hashed)
        if call is None:
            return await orig(self, args, *rest, **kwargs)
        try:
            result = await orig(self, passed, *rest, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            finish_many(call, n, passed)
            call.finish()
            raise
        call.finish()
        try:
            finish_many(call, n, passed)
            call.rows = _rows(how, result)
        except Exception:
            _internal_error()
        return result

    return _patch.mark(method, orig)


_CONN = {
    "execute": (_wrap_conn, "status"),
    "fetch": (_wrap_conn, "list"),
    "fetchrow": (_wrap_conn, "row"),
    "fetchval": (_wrap_conn, "val"),
    "executemany": (_wrap_conn_many, ""),
    "fetchmany": (_wrap_conn_many, "list"),
}
_STMT = {
    "fetch": (_wrap_stmt, "list"),
    "fetchrow": (_wrap_stmt, "row"),
    "fetchval": (_wrap_stmt, "val"),
    "executemany": (_wrap_stmt_many, ""),
    "fetchmany": (_wrap_stmt_many, "list"),
}


def _patch_class(cls: Any, table: dict[str, tuple[Callable[..., Any], str]]) -> None:
    for name, (wrap, how) in table.items():
        _patch.patch(cls, name, functools.partial(_bound, wrap, how))


def _bound(wrap: Callable[[Any, str], Any], how: str, orig: Any) -> Any:
    return wrap(orig, how)


def patch(module: ModuleType) -> None:
    import asyncpg.connection
    import asyncpg.prepared_stmt

    _patch_class(asyncpg.connection.Connection, _CONN)
    _patch_class(asyncpg.prepared_stmt.PreparedStatement, _STMT)
