"""DB-API drivers: sqlite3, psycopg (3), psycopg2 and PyMySQL.

Every statement executed inside a request becomes one ``db`` call carrying the SQL text as
given (a reference to the app's string), the bound parameters (a reference: hashed later by
the writer), the duration of ``execute``, the rows and any error class name.

How each driver is hooked (none of them changes what the application sees):

* **sqlite3** -- its types are C types whose methods cannot be replaced, so
  ``sqlite3.connect`` (and ``sqlite3.dbapi2.connect``) is wrapped to pass a ``factory=``
  subclass of ``sqlite3.Connection`` (a user-given factory class is subclassed once, our mixin
  placed *after* it in the MRO so its overrides still run first). That connection's
  ``cursor()`` hands out an instrumented subclass of the requested cursor class (Django's
  ``SQLiteCursorWrapper`` included) and its ``execute``/``executemany``/``executescript``
  shortcuts create an instrumented plain cursor, exactly like the C shortcuts do.
  ``isinstance(conn, sqlite3.Connection)`` and ``isinstance(cur, sqlite3.Cursor)`` hold.
  sqlite3 does not know how many rows a SELECT returns until they are stepped through, so
  rows are counted as the application fetches them (``fetchall``: one ``len``; iteration
  and ``fetchone``: one attribute test and an increment per row). The call's duration is
  that of ``execute`` (which steps to the first row), not of the later fetches.
* **psycopg 3** -- ``Cursor``/``AsyncCursor`` and ``ServerCursor``/``AsyncServerCursor``
  ``execute``/``executemany`` are replaced on the classes (pure Python); client cursors know
  the row count (``rowcount``) right after ``execute``.
* **psycopg2** -- C types again: ``psycopg2.connect`` is wrapped to pass a
  ``connection_factory`` subclass whose ``cursor()`` substitutes an instrumented subclass of
  the cursor factory that would have been used (argument, ``conn.cursor_factory`` or the
  default), cached per class; ``RealDictCursor``, ``DictCursor``, ``NamedTupleCursor``,
  ``LoggingCursor`` ... keep working as themselves.
* **PyMySQL** -- ``pymysql.cursors.Cursor.execute``/``executemany`` are replaced (pure
  Python). PyMySQL's ``executemany`` calls ``execute`` per row or batch: those nested calls
  are not recorded again.

What a recorded statement holds, ``executemany`` and the rows rule are in
:mod:`~perfsleuth.agent.instrument.dbcall`, whose wrappers every driver here uses but for
sqlite3's ``execute`` and fetches (filled in place, as the C accelerator does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from perfsleuth.agent import accel, recorder
from perfsleuth.agent.instrument._patch import is_ours, is_patched, mark, patch
from perfsleuth.agent.instrument.dbcall import (
    NESTED,
    known_rows,
    sql_text,
    wrap_async_execute,
    wrap_async_executemany,
    wrap_execute,
    wrap_executemany,
)

_start_call = recorder.start_call
_current_get = recorder.current_get
speedups = accel.module
_perf = time.perf_counter_ns
END, ROWS = recorder.END, recorder.ROWS
_set_field = recorder.set_field
_add_rows = recorder.add_rows
_internal_error = recorder.internal_error


# What _subclass does not copy from a mixin: the slot's descriptor (__slots__ makes a new one)
_NOT_COPIED = (
    "__dict__",
    "__weakref__",
    "__module__",
    "__qualname__",
    "__doc__",
    "_perfsleuth_rows",
)


def _subclass(base: type, mixin: type, cache: dict[Any, Any]) -> Any:
    """``base`` with ``mixin`` after it in the MRO (cached); ``base`` itself if impossible."""
    try:
        return cache[base]
    except KeyError:
        pass
    except TypeError:  # unhashable factory
        return base
    cls: Any = base
    if isinstance(base, type) and not issubclass(base, mixin):
        names = {"__module__": base.__module__, "__qualname__": base.__qualname__}
        try:
            cls = type(base.__name__, (base, mixin), names)
        except TypeError:  # both add slots (a layout conflict): the mixin's dict on top
            own = {k: v for k, v in vars(mixin).items() if k not in _NOT_COPIED}
            try:
                cls = type(base.__name__, (base,), {**own, **names})
            except Exception:
                cls = base
        except Exception:
            cls = base
    if len(cache) > 1000:
        cache.clear()
    cache[base] = cls
    return cls


# ---------------------------------------------------------------------------------------------
# sqlite3


def _stop_counting(cursor: Any) -> None:
    cursor._perfsleuth_rows = None


def _make_sqlite(dbapi: Any) -> tuple[type, type]:
    """Instrumented Connection and Cursor classes for a sqlite DB-API module."""
    base_conn: Any = dbapi.Connection
    base_cur: Any = dbapi.Cursor
    c_execute = base_cur.execute
    c_executemany = base_cur.executemany
    c_executescript = base_cur.executescript
    c_fetchone = base_cur.fetchone
    c_fetchmany = base_cur.fetchmany
    c_fetchall = base_cur.fetchall
    c_next = base_cur.__next__
    c_cursor = base_conn.cursor
    empty = ()
    cursor_classes: dict[Any, Any] = {}

    class Cursor(base_cur):  # type: ignore[misc, valid-type]
        # _perfsleuth_rows: (the request's call rows, offset of the ROWS of the SELECT being
        # fetched), as sqlite only knows how many rows a SELECT returns as they are stepped
        # through; unset or None: not counting. A slot, not an instance dict (a plain sqlite3
        # cursor has none either): the C wrappers read and write it in place.
        __slots__ = ("_perfsleuth_rows",)
        _perfsleuth_rows: tuple[bytearray, int] | None

        def execute(self, sql: Any, parameters: Any = empty, /) -> Any:
            # The hottest wrapper of all (a statement takes microseconds): the call's row is
            # filled in place rather than through a recorder.Call handle.
            req = _current_get()
            if req is None:
                self._perfsleuth_rows = None
                return c_execute(self, sql, parameters)
            i = req.record_call(
                "db", "sqlite", sql if type(sql) is str else sql_text(sql), parameters, 2
            )
            if i < 0:
                self._perfsleuth_rows = None
                return c_execute(self, sql, parameters)
            try:
                cur = c_execute(self, sql, parameters)
            except BaseException as exc:
                self._perfsleuth_rows = None
                req.fail_call(i, exc)
                raise
            calls: Any = req.calls
            _set_field(calls, i + END, _perf())
            try:
                if self.description is None:
                    self._perfsleuth_rows = None
                    rows = known_rows(self.rowcount)
                    if rows is not None:
                        _set_field(calls, i + ROWS, rows)
                else:
                    _set_field(calls, i + ROWS, 0)
                    self._perfsleuth_rows = (calls, i + ROWS)  # type: ignore[assignment]
            except Exception:
                _internal_error()
            return cur

        executemany = wrap_executemany(
            c_executemany, "sqlite", "seq_of_parameters", before=_stop_counting
        )

        def executescript(self, sql_script: Any, /) -> Any:
            self._perfsleuth_rows = None
            call = _start_call(
                "db",
                "sqlite",
                sql_script if type(sql_script) is str else sql_text(sql_script),
                None,
                2,
            )
            if call is None:
                return c_executescript(self, sql_script)
            try:
                return c_executescript(self, sql_script)
            except BaseException as exc:
                call.error = type(exc).__name__
                raise
            finally:
                call.finish()

        def fetchone(self) -> Any:
            row = c_fetchone(self)
            counting: Any = getattr(self, "_perfsleuth_rows", None)
            if counting is not None:
                if row is None:
                    self._perfsleuth_rows = None
                else:
                    _add_rows(counting[0], counting[1], 1)
            return row

        def fetchmany(self, *args: Any, **kwargs: Any) -> Any:
            rows = c_fetchmany(self, *args, **kwargs)
            counting: Any = getattr(self, "_perfsleuth_rows", None)
            if counting is not None:
                _add_rows(counting[0], counting[1], len(rows))
            return rows

        def fetchall(self) -> Any:
            rows = c_fetchall(self)
            counting: Any = getattr(self, "_perfsleuth_rows", None)
            if counting is not None:
                self._perfsleuth_rows = None
                _add_rows(counting[0], counting[1], len(rows))
            return rows

        def __next__(self) -> Any:
            row = c_next(self)  # StopIteration at the end propagates as the protocol wants
            counting: Any = getattr(self, "_perfsleuth_rows", None)
            if counting is not None:
                _add_rows(counting[0], counting[1], 1)
            return row

    def cursor_class(factory: Any) -> Any:
        if factory is None or factory is base_cur:
            return Cursor
        return _subclass(factory, Cursor, cursor_classes)

    class Connection(base_conn):  # type: ignore[misc, valid-type]
        def cursor(self, factory: Any = None) -> Any:
            try:
                factory = cursor_class(factory)
            except Exception:
                _internal_error()
            if factory is None:
                return c_cursor(self)
            return c_cursor(self, factory)

        # The C shortcuts always create a plain cursor (they ignore cursor() overrides).
        def execute(self, sql: Any, parameters: Any = empty, /) -> Any:
            return c_cursor(self, Cursor).execute(sql, parameters)

        def executemany(self, sql: Any, parameters: Any, /) -> Any:
            return c_cursor(self, Cursor).executemany(sql, parameters)

        def executescript(self, sql_script: Any, /) -> Any:
            return c_cursor(self, Cursor).executescript(sql_script)

    for cls in (Cursor, Connection):
        cls.__name__ = cls.__qualname__ = cls.__mro__[1].__name__
    python_methods = {name: Cursor.__dict__[name] for name in _ACCELERATED}
    python_conn = {name: Connection.__dict__[name] for name in ("cursor", "execute")}
    c_methods: dict[str, Any] = {}
    c_conn: dict[str, Any] = {}
    if speedups is not None:
        try:
            method = speedups.CursorMethod
            c_methods = {
                name: method(getattr(base_cur, name), getattr(speedups, kind), Cursor)
                for name, kind in _ACCELERATED.items()
            }
            c_conn = {
                "cursor": method(c_cursor, speedups.CONN_CURSOR, Cursor, python_conn["cursor"]),
                "execute": method(
                    c_cursor,
                    speedups.CONN_EXECUTE,
                    Cursor,
                    python_conn["execute"],
                    c_methods["execute"],
                ),
            }
        except Exception:
            _internal_error()
            c_methods = c_conn = {}
    _sqlite_methods.append((Cursor, python_methods, c_methods))
    _sqlite_methods.append((Connection, python_conn, c_conn))
    _use(Cursor, c_methods or python_methods)
    _use(Connection, c_conn or python_conn)
    return Connection, Cursor


# The sqlite cursor methods the C accelerator (agent/_speedups.c) does too, and its kinds
_ACCELERATED = {
    "execute": "EXECUTE",
    "fetchone": "FETCHONE",
    "fetchmany": "FETCHMANY",
    "fetchall": "FETCHALL",
    "__next__": "NEXT",
}
# (instrumented class, its Python methods, their C versions) of every sqlite DB-API module
_sqlite_methods: list[tuple[type, dict[str, Any], dict[str, Any]]] = []


def _use(cls: type, methods: dict[str, Any]) -> None:
    for name, method in methods.items():
        setattr(cls, name, method)


def use_speedups(on: bool) -> bool:
    """Record sqlite statements with the C wrappers (``on``) or the Python ones; returns whether
    the C ones are in use (False when the accelerator is not built or PERFSLEUTH_SPEEDUPS=0).
    For tests and benchmarks: both record the same values."""
    used = False
    for cls, python_methods, c_methods in _sqlite_methods:
        _use(cls, c_methods if on and c_methods else python_methods)
        used = used or bool(on and c_methods)
    return used


_sqlite_state: dict[int, tuple[type, type, dict[Any, Any]]] = {}


def patch_sqlite_dbapi(dbapi: Any) -> None:
    """Wrap ``dbapi.connect`` of a sqlite DB-API module (``sqlite3.dbapi2`` or alike)."""
    orig = getattr(dbapi, "connect", None)
    if orig is None or is_ours(orig):
        return
    key = id(dbapi.Connection)
    state = _sqlite_state.get(key)
    if state is None:
        conn_cls, cur_cls = _make_sqlite(dbapi)
        state = _sqlite_state[key] = (conn_cls, cur_cls, {})
    conn_cls, _, conn_classes = state
    base_conn = dbapi.Connection

    def connection_class(factory: Any) -> Any:
        if factory is None or factory is base_conn:
            return conn_cls
        return _subclass(factory, conn_cls, conn_classes)

    def connect(*args: Any, **kwargs: Any) -> Any:
        try:
            if len(args) > 5:
                args = (*args[:5], connection_class(args[5]), *args[6:])
            else:
                kwargs["factory"] = connection_class(kwargs.get("factory"))
        except Exception:
            _internal_error()
        return orig(*args, **kwargs)

    dbapi.connect = mark(connect, orig)


def patch_sqlite3(module: ModuleType) -> None:
    import sqlite3
    import sqlite3.dbapi2

    patch_sqlite_dbapi(sqlite3.dbapi2)
    wrapped = sqlite3.dbapi2.connect
    for mod in (sqlite3, module):
        if not is_ours(getattr(mod, "connect", None)):
            mod.connect = wrapped  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# psycopg (3)


def patch_psycopg(module: ModuleType) -> None:
    import psycopg

    sync = [getattr(psycopg, "Cursor", None), getattr(psycopg, "ServerCursor", None)]
    asyn = [getattr(psycopg, "AsyncCursor", None), getattr(psycopg, "AsyncServerCursor", None)]
    for cls in sync:
        if cls is not None:
            patch(cls, "execute", lambda orig: wrap_execute(orig, "postgresql", "params"))
            patch(cls, "executemany", lambda o: wrap_executemany(o, "postgresql", "params_seq"))
    for cls in asyn:
        if cls is not None:
            patch(cls, "execute", lambda orig: wrap_async_execute(orig, "postgresql", "params"))
            patch(
                cls,
                "executemany",
                lambda orig: wrap_async_executemany(orig, "postgresql", "params_seq"),
            )


# ---------------------------------------------------------------------------------------------
# psycopg2


def _make_psycopg2(ext: Any) -> tuple[type, Callable[[Any], Any]]:
    base_cur: Any = ext.cursor
    base_conn: Any = ext.connection
    c_execute = base_cur.execute
    c_executemany = base_cur.executemany
    c_cursor = base_conn.cursor
    cursor_classes: dict[Any, Any] = {}

    class Cursor(base_cur):  # type: ignore[misc, valid-type]
        execute = wrap_execute(c_execute, "postgresql", "vars")
        executemany = wrap_executemany(c_executemany, "postgresql", "vars_list")

    def cursor_class(factory: Any) -> Any:
        if factory is None or factory is base_cur:
            return Cursor
        return _subclass(factory, Cursor, cursor_classes)

    class Connection(base_conn):  # type: ignore[misc, valid-type]
        def cursor(self, *args: Any, **kwargs: Any) -> Any:
            try:
                if len(args) >= 2:
                    args = (args[0], cursor_class(args[1] or self.cursor_factory), *args[2:])
                else:
                    kwargs["cursor_factory"] = cursor_class(
                        kwargs.get("cursor_factory") or self.cursor_factory
                    )
            except Exception:
                _internal_error()
            return c_cursor(self, *args, **kwargs)

    for cls in (Cursor, Connection):
        cls.__name__ = cls.__qualname__ = cls.__mro__[1].__name__

    conn_classes: dict[Any, Any] = {}

    def connection_class(factory: Any) -> Any:
        if factory is None or factory is base_conn:
            return Connection
        return _subclass(factory, Connection, conn_classes)

    return Cursor, connection_class


def patch_psycopg2(module: ModuleType) -> None:
    import psycopg2
    import psycopg2.extensions

    orig = psycopg2.connect
    if is_ours(orig):
        return
    _, connection_class = _make_psycopg2(psycopg2.extensions)

    def connect(
        dsn: Any = None, connection_factory: Any = None, cursor_factory: Any = None, **kwargs: Any
    ) -> Any:
        try:
            connection_factory = connection_class(connection_factory)
        except Exception:
            _internal_error()
        return orig(dsn, connection_factory, cursor_factory, **kwargs)

    psycopg2.connect = mark(connect, orig)


# ---------------------------------------------------------------------------------------------
# PyMySQL


def patch_pymysql(module: ModuleType) -> None:
    import pymysql.cursors

    cls: Any = pymysql.cursors.Cursor
    if is_patched(cls, "execute"):
        return
    setattr(cls, NESTED, False)
    # PyMySQL's executemany runs through execute: nested=True records it once.
    patch(cls, "execute", lambda orig: wrap_execute(orig, "mysql", "args", nested=True))
    patch(cls, "executemany", lambda orig: wrap_executemany(orig, "mysql", "args", nested=True))
