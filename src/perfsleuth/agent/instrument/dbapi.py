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

``executemany`` records one call with ``extra={"many": n}``; parameters of a sized sequence
are passed for hashing, an unsized iterable (generator, ``itertools.tee``) is passed to the
driver through a counting iterator and not hashed.

Outside a request ``start_call`` returns None and the wrappers only forward the call.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

from perfsleuth.agent import recorder

_start_call = recorder.start_call
_current_get = recorder.current_get
speedups = recorder.speedups
_perf = time.perf_counter_ns
END, ROWS = recorder.END, recorder.ROWS
_set_field = recorder.set_field
_add_rows = recorder.add_rows
_internal_error = recorder.internal_error
_MARK = "_perfsleuth_orig"
_MAX_ROWCOUNT = 1 << 62  # pymysql reports 2**64-1 for unbuffered results: unknown


def sql_text(query: Any, ctx: Any = None) -> str:
    """The statement as text when the app did not pass a str (bytes, psycopg ``sql.Composed``).
    Never raises."""
    try:
        if isinstance(query, str):
            return query
        if isinstance(query, (bytes, bytearray, memoryview)):
            return bytes(query).decode("utf-8", "replace")
        as_string = getattr(query, "as_string", None)
        if as_string is not None:
            try:
                return str(as_string(ctx))
            except Exception:
                pass
        return str(query)
    except Exception:
        _internal_error()
        return "<unknown statement>"


if speedups is not None:
    speedups.configure(sql_text=sql_text)


class CountingIter:
    """Iterates an unsized ``executemany`` argument, counting the items the driver took."""

    __slots__ = ("count", "it")

    def __init__(self, it: Iterable[Any]) -> None:
        self.it = iter(it)
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = next(self.it)
        self.count += 1
        return item


def many_args(seq: Any) -> tuple[Any, Any, int | None]:
    """(what to pass to the driver, what to hash, n or None when only known afterwards)."""
    if hasattr(seq, "__len__"):
        try:
            return seq, seq, len(seq)
        except Exception:
            return seq, None, None
    try:
        return CountingIter(seq), None, None
    except Exception:  # not iterable: let the driver raise its own error
        return seq, None, None


def finish_many(call: recorder.Call, n: int | None, passed: Any) -> None:
    """Set ``extra={"many": n}`` (n counted by the driver's iteration when unsized)."""
    try:
        if n is None and isinstance(passed, CountingIter):
            n = passed.count
        call.extra = {"many": n}
    except Exception:
        _internal_error()


def _is_patched(owner: Any, name: str) -> bool:
    return hasattr(owner.__dict__.get(name), _MARK)


def _mark(wrapper: Any, orig: Any) -> Any:
    try:
        functools.update_wrapper(wrapper, orig)
    except Exception:
        pass
    setattr(wrapper, _MARK, orig)
    return wrapper


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
                    rc = self.rowcount
                    if rc >= 0:
                        _set_field(calls, i + ROWS, rc)
                else:
                    _set_field(calls, i + ROWS, 0)
                    self._perfsleuth_rows = (calls, i + ROWS)  # type: ignore[assignment]
            except Exception:
                _internal_error()
            return cur

        def executemany(self, sql: Any, seq_of_parameters: Any, /) -> Any:
            self._perfsleuth_rows = None
            passed, hashed, n = many_args(seq_of_parameters)
            call = _start_call(
                "db", "sqlite", sql if type(sql) is str else sql_text(sql), hashed, 2
            )
            if call is None:
                return c_executemany(self, sql, seq_of_parameters)
            try:
                cur = c_executemany(self, sql, passed)
            except BaseException as exc:
                call.error = type(exc).__name__
                finish_many(call, n, passed)
                call.finish()
                raise
            call.finish()
            try:
                finish_many(call, n, passed)
                rc = self.rowcount
                if rc >= 0:
                    call.rows = rc
            except Exception:
                _internal_error()
            return cur

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
    if orig is None or hasattr(orig, _MARK):
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

    dbapi.connect = _mark(connect, orig)


def patch_sqlite3(module: ModuleType) -> None:
    import sqlite3
    import sqlite3.dbapi2

    patch_sqlite_dbapi(sqlite3.dbapi2)
    wrapped = sqlite3.dbapi2.connect
    for mod in (sqlite3, module):
        if not hasattr(getattr(mod, "connect", None), _MARK):
            mod.connect = wrapped  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# psycopg (3)


def _wrap_sync_execute(orig: Callable[..., Any], system: str) -> Callable[..., Any]:
    def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        call = _start_call(
            "db", system, query if type(query) is str else sql_text(query, self), params, 2
        )
        if call is None:
            return orig(self, query, params, **kwargs)
        try:
            result = orig(self, query, params, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            call.finish()
            raise
        call.finish()
        try:
            rc = self.rowcount
            if rc is not None and 0 <= rc < _MAX_ROWCOUNT:
                call.rows = rc
        except Exception:
            _internal_error()
        return result

    return _mark(execute, orig)


def _wrap_sync_executemany(orig: Callable[..., Any], system: str) -> Callable[..., Any]:
    def executemany(self: Any, query: Any, params_seq: Any, **kwargs: Any) -> Any:
        passed, hashed, n = many_args(params_seq)
        call = _start_call(
            "db", system, query if type(query) is str else sql_text(query, self), hashed, 2
        )
        if call is None:
            return orig(self, query, params_seq, **kwargs)
        try:
            result = orig(self, query, passed, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            finish_many(call, n, passed)
            call.finish()
            raise
        call.finish()
        try:
            finish_many(call, n, passed)
            rc = self.rowcount
            if rc is not None and 0 <= rc < _MAX_ROWCOUNT:
                call.rows = rc
        except Exception:
            _internal_error()
        return result

    return _mark(executemany, orig)


def _wrap_async_execute(orig: Callable[..., Any], system: str) -> Callable[..., Any]:
    async def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        call = _start_call(
            "db", system, query if type(query) is str else sql_text(query, self), params, 2
        )
        if call is None:
            return await orig(self, query, params, **kwargs)
        try:
            result = await orig(self, query, params, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            call.finish()
            raise
        call.finish()
        try:
            rc = self.rowcount
            if rc is not None and 0 <= rc < _MAX_ROWCOUNT:
                call.rows = rc
        except Exception:
            _internal_error()
        return result

    return _mark(execute, orig)


def _wrap_async_executemany(orig: Callable[..., Any], system: str) -> Callable[..., Any]:
    async def executemany(self: Any, query: Any, params_seq: Any, **kwargs: Any) -> Any:
        passed, hashed, n = many_args(params_seq)
        call = _start_call(
            "db", system, query if type(query) is str else sql_text(query, self), hashed, 2
        )
        if call is None:
            return await orig(self, query, params_seq, **kwargs)
        try:
            result = await orig(self, query, passed, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            finish_many(call, n, passed)
            call.finish()
            raise
        call.finish()
        try:
            finish_many(call, n, passed)
            rc = self.rowcount
            if rc is not None and 0 <= rc < _MAX_ROWCOUNT:
                call.rows = rc
        except Exception:
            _internal_error()
        return result

    return _mark(executemany, orig)


def _patch_method(cls: Any, name: str, wrap: Callable[..., Any], system: str) -> None:
    if cls is None or _is_patched(cls, name):
        return
    orig = cls.__dict__.get(name)
    if orig is None:
        return
    setattr(cls, name, wrap(orig, system))


def patch_psycopg(module: ModuleType) -> None:
    import psycopg

    sync = [getattr(psycopg, "Cursor", None), getattr(psycopg, "ServerCursor", None)]
    asyn = [getattr(psycopg, "AsyncCursor", None), getattr(psycopg, "AsyncServerCursor", None)]
    for cls in sync:
        _patch_method(cls, "execute", _wrap_sync_execute, "postgresql")
        _patch_method(cls, "executemany", _wrap_sync_executemany, "postgresql")
    for cls in asyn:
        _patch_method(cls, "execute", _wrap_async_execute, "postgresql")
        _patch_method(cls, "executemany", _wrap_async_executemany, "postgresql")


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
        def execute(self, query: Any, vars: Any = None) -> Any:
            call = _start_call(
                "db", "postgresql", query if type(query) is str else sql_text(query, self), vars, 2
            )
            if call is None:
                return c_execute(self, query, vars)
            try:
                result = c_execute(self, query, vars)
            except BaseException as exc:
                call.error = type(exc).__name__
                call.finish()
                raise
            call.finish()
            try:
                rc = self.rowcount
                if rc >= 0:
                    call.rows = rc
            except Exception:
                _internal_error()
            return result

        def executemany(self, query: Any, vars_list: Any) -> Any:
            passed, hashed, n = many_args(vars_list)
            call = _start_call(
                "db",
                "postgresql",
                query if type(query) is str else sql_text(query, self),
                hashed,
                2,
            )
            if call is None:
                return c_executemany(self, query, vars_list)
            try:
                result = c_executemany(self, query, passed)
            except BaseException as exc:
                call.error = type(exc).__name__
                finish_many(call, n, passed)
                call.finish()
                raise
            call.finish()
            try:
                finish_many(call, n, passed)
                rc = self.rowcount
                if rc >= 0:
                    call.rows = rc
            except Exception:
                _internal_error()
            return result

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
    if hasattr(orig, _MARK):
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

    psycopg2.connect = _mark(connect, orig)


# ---------------------------------------------------------------------------------------------
# PyMySQL


def patch_pymysql(module: ModuleType) -> None:
    import pymysql.cursors

    cls: Any = pymysql.cursors.Cursor
    if _is_patched(cls, "execute"):
        return
    orig_execute = cls.__dict__["execute"]
    orig_executemany = cls.__dict__["executemany"]

    def execute(self: Any, query: Any, args: Any = None) -> Any:
        if self._perfsleuth_nested:
            return orig_execute(self, query, args)
        call = _start_call("db", "mysql", query if type(query) is str else sql_text(query), args, 2)
        if call is None:
            return orig_execute(self, query, args)
        try:
            result = orig_execute(self, query, args)
        except BaseException as exc:
            call.error = type(exc).__name__
            call.finish()
            raise
        call.finish()
        try:
            rc = self.rowcount
            if rc is not None and 0 <= rc < _MAX_ROWCOUNT:
                call.rows = rc
        except Exception:
            _internal_error()
        return result

    def executemany(self: Any, query: Any, args: Any) -> Any:
        if self._perfsleuth_nested:
            return orig_executemany(self, query, args)
        passed, hashed, n = many_args(args)
        call = _start_call(
            "db", "mysql", query if type(query) is str else sql_text(query), hashed, 2
        )
        if call is None:
            passed = args
        self._perfsleuth_nested = True  # PyMySQL runs executemany through execute
        try:
            result = orig_executemany(self, query, passed)
        except BaseException as exc:
            if call is not None:
                call.error = type(exc).__name__
                finish_many(call, n, passed)
                call.finish()
            raise
        finally:
            self._perfsleuth_nested = False
        if call is not None:
            call.finish()
            try:
                finish_many(call, n, passed)
                rc = self.rowcount
                if rc is not None and 0 <= rc < _MAX_ROWCOUNT:
                    call.rows = rc
            except Exception:
                _internal_error()
        return result

    cls._perfsleuth_nested = False
    cls.execute = _mark(execute, orig_execute)
    cls.executemany = _mark(executemany, orig_executemany)
