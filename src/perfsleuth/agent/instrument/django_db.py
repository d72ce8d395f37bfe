"""Django ORM: every statement a Django connection executes is recorded once, through Django's
own hook, whatever the backend and the Django version.

**Django's hook.** ``connection.execute_wrappers`` (Django >= 2.0) run around every
``execute``/``executemany`` of Django's cursor wrapper, for every backend. :func:`execute_wrapper`
is put on each connection when it connects (the ``connection_created`` signal, hooked by
:func:`install` when Django's request handler, its sqlite backend or its backends' signals
module is imported; connections already open when the agent starts are not covered), outermost
of the connection's wrappers. It records the statement as Django hands
it to the backend (``%s`` placeholders: the fingerprint normalises them like ``?``), its
parameters, duration and rows, from the application frame above Django's (the view or model
line), exactly as the driver patches do.

Why not only the driver patches (:mod:`perfsleuth.agent.instrument.dbapi`): Django 3.2's sqlite
backend runs ``Database.Cursor.execute(self, ...)``, the C method of the base class, which
bypasses the instrumented cursor subclass: an N+1 page showed 1 statement instead of 61.

**No double count.** While the wrapper runs the statement, the request is hidden from the
driver layer (``recorder._current`` is None, as in :func:`recorder.suppressed`): the driver
patches (Python and C) only forward outside a request. Rows are counted as the driver layer
counts them: ``rowcount`` after ``execute``, except a sqlite SELECT, whose rows are counted as
the application fetches them (the wrapper hands the call's ROWS field to the instrumented
cursor's ``_perfsleuth_rows``, which its fetch methods advance).

**What stays with the driver layer.** Statements Django runs on the raw DB-API connection,
outside its cursor wrapper: connection set-up (``PRAGMA``, ``SET TIME ZONE``), the
``SELECT QUOTE(?)`` helper of ``last_executed_query`` with ``DEBUG=True``, liveness checks.
They are recorded by the driver patches as before, and the store files them as framework
internals (:mod:`perfsleuth.wire.internal_sql`), which no detector counts.

:func:`patch_sqlite_backend`, run when Django's sqlite backend is imported, also makes sure the
module object the backend uses as ``Database`` is patched (it is ``sqlite3.dbapi2`` unless a
project swaps in a compatible module such as ``pysqlite3.dbapi2``). Everything is idempotent.
"""

from __future__ import annotations

import importlib
import sys
import time
from types import ModuleType
from typing import Any

from perfsleuth.agent import recorder
from perfsleuth.agent.instrument import dbapi, dbcall

_current = recorder._current
_current_get = recorder.current_get
_perf = time.perf_counter_ns
_set_field = recorder.set_field
_internal_error = recorder.internal_error
_c_record_call = recorder._c_record_call
END, ROWS = recorder.END, recorder.ROWS
_MAX_ROWCOUNT = 1 << 62
# Django's ``connection.vendor`` -> the wire's system name (others are passed as they are)
_SYSTEMS = {"sqlite": "sqlite", "postgresql": "postgresql", "mysql": "mysql"}
_DISPATCH_UID = "perfsleuth.agent.instrument.django_db"


def execute_wrapper(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
    """A Django execute wrapper: records the statement as one ``db`` call of the request."""
    req = _current_get()
    if req is None:
        return execute(sql, params, many, context)
    passed = params
    n = None
    try:
        vendor: Any = getattr(context.get("connection"), "vendor", None)
        system = _SYSTEMS.get(vendor) or _system(context)
        text = sql if type(sql) is str else dbcall.sql_text(sql)
        if many:
            passed, hashed, n = dbcall.many_args(params)
            i = req.record_call("db", system, text, hashed, 2)
        elif _c_record_call is not None:
            # Straight to the C site path: the caller is Django's cursor wrapper, never the
            # application line record_call's fast path keys by (up=1: this function's caller)
            i = _c_record_call(req, "db", system, text, params, 1)
            if i < 0:
                # -1: the C path could not: Python's (not record_call, which would try C again)
                i = req._record_call("db", system, text, params, 2) if i == -1 else -1
        else:
            i = req.record_call("db", system, text, params, 2)
    except Exception:
        _internal_error()
        i = -1
    token = _current.set(None)  # the driver patches forward without recording
    try:
        result = execute(sql, passed, many, context)
    except BaseException as exc:
        if i >= 0:
            req.fail_call(i, exc)
            if many:
                _finish_many(req, i, n, passed, None)
        raise
    finally:
        _current.reset(token)
    if i >= 0:
        try:
            calls: Any = req.calls
            _set_field(calls, i + END, _perf())
            cursor = getattr(context.get("cursor"), "cursor", None)  # the DB-API cursor
            if many:
                _finish_many(req, i, n, passed, cursor)
            else:
                _count_rows(calls, i, cursor)
        except Exception:
            _internal_error()
    return result


def _system(context: Any) -> str:
    vendor = str(getattr(context.get("connection"), "vendor", "") or "sql")
    return _SYSTEMS.get(vendor, vendor)


def _count_rows(calls: Any, i: int, cursor: Any) -> None:
    if cursor is None:
        return
    cls = type(cursor)
    counting = _counting_classes.get(cls)
    if counting is None:
        counting = hasattr(cls, "_perfsleuth_rows")
        if len(_counting_classes) > 1000:
            _counting_classes.clear()
        _counting_classes[cls] = counting
    if counting:  # an instrumented sqlite cursor
        if cursor.description is None:
            cursor._perfsleuth_rows = None
            rc = cursor.rowcount
            if rc >= 0:
                _set_field(calls, i + ROWS, rc)
        else:  # counted as the application fetches them, as the sqlite wrappers do
            _set_field(calls, i + ROWS, 0)
            cursor._perfsleuth_rows = (calls, i + ROWS)
        return
    rc = getattr(cursor, "rowcount", None)
    if type(rc) is int and 0 <= rc < _MAX_ROWCOUNT:
        _set_field(calls, i + ROWS, rc)


# cursor class -> whether it is an instrumented sqlite cursor (hasattr of a missing attribute
# raises and catches an AttributeError: once per class, not per statement)
_counting_classes: dict[type, bool] = {}


def _finish_many(req: Any, i: int, n: int | None, passed: Any, cursor: Any) -> None:
    try:
        if n is None and isinstance(passed, dbcall.CountingIter):
            n = passed.count
        req._note(i, "extra", {"many": n})
        rc = getattr(cursor, "rowcount", None)
        if type(rc) is int and 0 <= rc < _MAX_ROWCOUNT:
            _set_field(req.calls, i + ROWS, rc)
    except Exception:
        _internal_error()


def install_wrapper(connection: Any) -> None:
    """Put :func:`execute_wrapper` on a Django connection, once, outermost: its caller is
    then Django's cursor wrapper, so the call site is found above it even when the application
    has an execute wrapper of its own (whose work is timed with the statement's)."""
    try:
        wrappers = connection.execute_wrappers
        if execute_wrapper not in wrappers:
            wrappers.insert(0, execute_wrapper)
    except Exception:
        _internal_error()


def _connection_created(sender: Any, connection: Any = None, **kwargs: Any) -> None:
    if connection is not None:
        install_wrapper(connection)


def install() -> None:
    """Have every Django connection that connects from now on recorded through
    :func:`execute_wrapper`. Idempotent; never raises."""
    try:
        signals: Any = sys.modules.get("django.db.backends.signals")
        if signals is None:
            signals = importlib.import_module("django.db.backends.signals")
        signals.connection_created.connect(
            _connection_created, weak=False, dispatch_uid=_DISPATCH_UID
        )
    except Exception:
        _internal_error()


def patch_signals(module: ModuleType) -> None:
    """Patch function for ``django.db.backends.signals`` (imported by every Django backend)."""
    install()


def patch_sqlite_backend(module: ModuleType) -> None:
    import sqlite3

    dbapi.patch_sqlite3(sqlite3)
    database = getattr(module, "Database", None)
    if database is not None and hasattr(database, "Cursor") and hasattr(database, "Connection"):
        dbapi.patch_sqlite_dbapi(database)
    install()
