"""One DB-API statement as a recorded ``db`` call: what every database driver's plugin shares.

A wrapped ``execute`` records the SQL text as given (a reference to the app's string), the
bound parameters (a reference: hashed later by the writer), the duration of the driver's
``execute``, the rows and any error class name. ``executemany`` records one call with
``extra={"many": n}``; parameters of a sized sequence are passed for hashing, an unsized
iterable (generator, ``itertools.tee``) is passed to the driver through a counting iterator
and not hashed.

Rows follow one rule (:func:`known_rows`): the cursor's ``rowcount`` after the statement when
it is a count, in ``[0, 2**62)``; DB-API's ``-1`` or ``None`` (not known: a SELECT on sqlite3
before its rows are fetched) and PyMySQL's ``2**64-1`` (an unbuffered result) leave the rows
unknown.

The wrappers keep the driver's signature: the parameters are the first argument after the
query, or the keyword the driver names them with. Outside a request ``start_call`` returns
None and the wrappers only forward the call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from perfsleuth.agent import accel, recorder
from perfsleuth.agent.instrument._patch import mark

_start_call = recorder.start_call
_current_get = recorder.current_get
_internal_error = recorder.internal_error
_set_field = recorder.set_field
_perf = time.perf_counter_ns
END, ROWS = recorder.END, recorder.ROWS
MAX_ROWCOUNT = 1 << 62
NESTED = "_perfsleuth_nested"  # on a cursor whose executemany runs through its execute


def known_rows(rowcount: Any) -> int | None:
    """The rows of a statement from the cursor's ``rowcount``, or None when it is not a count."""
    if type(rowcount) is int and 0 <= rowcount < MAX_ROWCOUNT:
        return rowcount
    return None


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


if accel.module is not None:
    accel.module.configure(sql_text=sql_text)


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


def _hashable(params: dict[Any, Any]) -> Any:
    """Named parameters (``%(name)s``: SQLAlchemy's on psycopg) as a tuple of their items in
    key order, which the recorder hashes on the request path like positional ones: a dict
    would be kept on the call's row for the writer to hash (two dicts and a look-up per call,
    and the application's values alive until then). The dict itself when its values cannot
    be hashed (the writer hashes their text)."""
    if not params:
        return ()
    try:
        items = tuple(sorted(params.items()))
        hash(items)
    except Exception:
        return params
    return items


# ------------------------------------------------------------------------------ the one body


def _failed(call: recorder.Call, exc: BaseException, many: Any) -> None:
    call.error = type(exc).__name__
    if many is not None:
        finish_many(call, many[0], many[1])
    call.finish()


def _done(call: recorder.Call, cursor: Any, many: Any) -> None:
    call.finish()
    try:
        if many is not None:
            finish_many(call, many[0], many[1])
        rows = known_rows(cursor.rowcount)
        if rows is not None:
            call.rows = rows
    except Exception:
        _internal_error()


def _many(
    args: tuple[Any, ...], kwargs: dict[str, Any], name: str
) -> tuple[tuple[Any, ...], dict[str, Any], Any, tuple[int | None, Any]]:
    """(args and keywords to pass on, what to hash, (n, what was passed)) of an
    ``executemany`` call (the caller's own args are left as they are)."""
    passed, hashed, n = many_args(args[0] if args else kwargs.get(name))
    if args:
        args = (passed, *args[1:])
    elif name in kwargs:
        kwargs = {**kwargs, name: passed}
    return args, kwargs, hashed, (n, passed)


def wrap_execute(
    orig: Callable[..., Any], system: str, params: str, *, nested: bool = False
) -> Callable[..., Any]:
    """``orig(cursor, query, params=None, **kwargs)`` recorded; ``params``: the driver's keyword
    for the parameters. ``nested``: not recorded while the cursor's executemany runs it."""

    # A fixed signature rather than *args, and the call's row filled in place rather than
    # through a recorder.Call handle: this runs for every statement of an N+1 loop. Outside a
    # request (Django's execute hook hides it from this layer while it records the statement)
    # it only forwards.
    def execute(self: Any, query: Any, args: Any = None, /, **kwargs: Any) -> Any:
        if kwargs and args is None and params in kwargs:
            args = kwargs.pop(params)  # kwargs is this call's own dict
        req = _current_get()
        if req is None or (nested and getattr(self, NESTED, False)):
            return orig(self, query, args, **kwargs)
        i = req.record_call(
            "db",
            system,
            query if type(query) is str else sql_text(query, self),
            _hashable(args) if type(args) is dict else args,
            2,
        )
        if i < 0:
            return orig(self, query, args, **kwargs)
        try:
            result = orig(self, query, args, **kwargs)
        except BaseException as exc:
            req.fail_call(i, exc)
            raise
        calls: Any = req.calls
        _set_field(calls, i + END, _perf())
        try:
            rows = self.rowcount
            if type(rows) is int and 0 <= rows < MAX_ROWCOUNT:  # known_rows
                _set_field(calls, i + ROWS, rows)
        except Exception:
            _internal_error()
        return result

    return mark(execute, orig)


def wrap_executemany(
    orig: Callable[..., Any],
    system: str,
    params: str,
    *,
    nested: bool = False,
    before: Callable[[Any], None] | None = None,
) -> Callable[..., Any]:
    """``orig(cursor, query, seq_of_params...)`` recorded as one call. ``nested``: the driver
    runs it through its own ``execute``, whose calls are not recorded again. ``before(cursor)``
    runs first, recorded or not (sqlite3: stop counting the fetches of an earlier SELECT)."""

    def executemany(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(self)
        if nested and getattr(self, NESTED, False):
            return orig(self, query, *args, **kwargs)
        call_args, call_kwargs, hashed, many = _many(args, kwargs, params)
        text = query if type(query) is str else sql_text(query, self)
        call = _start_call("db", system, text, hashed, 2)
        if call is None:
            return orig(self, query, *args, **kwargs)
        if nested:
            setattr(self, NESTED, True)
        try:
            result = orig(self, query, *call_args, **call_kwargs)
        except BaseException as exc:
            _failed(call, exc, many)
            raise
        finally:
            if nested:
                setattr(self, NESTED, False)
        _done(call, self, many)
        return result

    return mark(executemany, orig)


def wrap_async_execute(orig: Callable[..., Any], system: str, params: str) -> Callable[..., Any]:
    """:func:`wrap_execute` for a coroutine method."""

    async def execute(self: Any, query: Any, args: Any = None, /, **kwargs: Any) -> Any:
        if kwargs and args is None and params in kwargs:
            args = kwargs.pop(params)
        call = _start_call(
            "db", system, query if type(query) is str else sql_text(query, self), args, 2
        )
        if call is None:
            return await orig(self, query, args, **kwargs)
        try:
            result = await orig(self, query, args, **kwargs)
        except BaseException as exc:
            _failed(call, exc, None)
            raise
        _done(call, self, None)
        return result

    return mark(execute, orig)


def wrap_async_executemany(
    orig: Callable[..., Any], system: str, params: str
) -> Callable[..., Any]:
    """:func:`wrap_executemany` for a coroutine method."""

    async def executemany(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        call_args, call_kwargs, hashed, many = _many(args, kwargs, params)
        text = query if type(query) is str else sql_text(query, self)
        call = _start_call("db", system, text, hashed, 2)
        if call is None:
            return await orig(self, query, *args, **kwargs)
        try:
            result = await orig(self, query, *call_args, **call_kwargs)
        except BaseException as exc:
            _failed(call, exc, many)
            raise
        _done(call, self, many)
        return result

    return mark(executemany, orig)
