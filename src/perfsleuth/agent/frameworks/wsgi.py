"""WSGI: ``PerfsleuthWSGI(app)`` records every request of a WSGI application (Flask, Django, ...).

Per request it keeps references and integers only: method, path, status, CONTENT_LENGTH, the
bytes of the response body as the server consumes it, the two configured identity headers and
the thread CPU time. The request ends exactly once: when the response iterable is exhausted,
when the server closes it (PEP 3333), or when the application raises.

Between the application's return and the end of the response the request is *not* left in the
thread's context (a server that never closes the iterable must not leave a stale request that
would hide the next ones); it is put back around each step of the iteration, so queries made by
a streaming generator are still attributed to it.

Endpoints come from the router: Flask's ``request.url_rule`` (read from Flask's request context
when the app calls start_response, or when it signals an unhandled exception; from its
request_started signal too once an app has a middleware on ``app.wsgi_app``), Django's
``resolver_match.route`` (through the Django middleware). A plain WSGI app without a known router
is recorded as ``"<METHOD> <unmatched>"``: the raw path is never used as an endpoint, so
scanners cannot blow up the number of endpoints.

The helpers shared with the ASGI and Django integrations are in :mod:`.common`.

With the C accelerator, ``record_wsgi`` and Flask's patched ``__call__`` are agent/_wsgi.c's
(``record_wsgi``, ``FlaskCall``): the same code path case for case, without the ~8 Python calls
a request of the classes below (``python_record_wsgi`` and ``_Body``, the reference, kept for
``PERFSLEUTH_SPEEDUPS=0`` and tested against it: tests/test_wsgi_c.py). The rare cases call back
into this module's helpers (``_unrecorded``, ``_name_from_flask``, ``_counted_write``,
``_declared_length``, ``_name_on_request_started``), whose names the C code looks up here.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from perfsleuth.agent import accel, capture, recorder
from perfsleuth.agent.frameworks import common
from perfsleuth.agent.frameworks.common import content_length, endpoint, read_environ

_get_ident = threading.get_ident
_current = recorder._current
_set = _current.set
_new = object.__new__
_END: Any = object()  # what next(iterator, _END) returns at the end (no StopIteration to catch)

# ------------------------------------------------------------------------------------- WSGI


class PerfsleuthWSGI:
    """WSGI middleware recording each request; attribute access falls through to the app."""

    def __init__(self, app: Any) -> None:
        self.app = app
        if "flask" in sys.modules:
            connect_flask()
            _name_on_request_started(app)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        return record_wsgi(self.app, environ, start_response)

    def __getattr__(self, name: str) -> Any:
        if name == "app":
            raise AttributeError(name)
        return getattr(self.app, name)

    def __repr__(self) -> str:
        return f"PerfsleuthWSGI({self.app!r})"


def python_record_wsgi(
    app: Callable[..., Any], environ: dict[str, Any], start_response: Callable[..., Any]
) -> Any:
    """Run ``app(environ, start_response)`` as one recorded request (unless one already runs).

    The reference: ``record_wsgi`` is this, or the same in C (agent/_wsgi.c) when the
    accelerator is there."""
    try:
        req = recorder.begin(
            "web", environ.get("REQUEST_METHOD") or "", environ.get("PATH_INFO") or "/", cpu=True
        )
    except Exception:
        req = None
    if req is None:
        return _unrecorded(app, environ, start_response)
    # every field of _Body (it has no __init__: one Python call less a request)
    body = _new(_Body)
    body._req = req
    body._environ = environ  # for a possible capture (agent.capture)
    body._tap = None
    body._start_response = start_response
    body._tid = req.thread
    body._sent = 0
    body._headers = body._iterable = body._it = None
    try:
        if read_environ(req, environ) and capture.on:
            body._tap = capture.tap_wsgi_input(environ)
    except Exception:  # identity and size are lost, not the request
        recorder.internal_error()
    try:
        result = app(environ, body.start_response)
    except BaseException as exc:
        body.fail(exc)
        raise
    return body.wrap(result, environ)


class _Body:
    """The response iterable of one request, counting bytes and ending the request once."""

    __slots__ = (
        "_environ",
        "_headers",
        "_it",
        "_iterable",
        "_req",
        "_sent",
        "_start_response",
        "_tap",
        "_tid",
    )

    # Made by record_wsgi without an __init__ (one Python call less a request), which sets
    # every field: _tid is the request's thread (req.thread, the thread that began it).
    _req: recorder.ActiveRequest | None
    _environ: Any  # for a possible capture (agent.capture)
    _tap: capture.BodyTap | None
    _start_response: Callable[..., Any]
    _tid: int
    _sent: int
    _headers: Any
    _iterable: Any
    _it: Iterator[bytes] | None

    # -- start_response ----------------------------------------------------------------------

    def start_response(self, status: str, headers: Any, exc_info: Any = None) -> Any:
        req = self._req
        if req is not None:
            try:
                req.status = int(str(status)[:3])
                self._headers = headers
                if _flask_request is not None and not req.endpoint:
                    # Flask calls start_response inside its request context: its matched
                    # URL rule names the endpoint, read here rather than from a signal
                    # (blinker's dispatch to a receiver costs ~13k instructions a request).
                    ctx = _flask_request.get(None)
                    if ctx is not None:
                        _name_from_flask(req, ctx)
            except Exception:
                recorder.internal_error()
        if exc_info is None:
            write = self._start_response(status, headers)
        else:
            write = self._start_response(status, headers, exc_info)
        if write is None:
            return write
        return _counted_write(self, write)

    # -- the application returned ------------------------------------------------------------

    def wrap(self, result: Any, environ: dict[str, Any]) -> Any:
        req = self._req
        if req is None:
            return result
        try:
            # Leave the thread's context clean: it is restored around each iteration step.
            token, req.token = req.token, None
            if token is not None:
                try:
                    _current.reset(token)
                except ValueError:
                    _current.set(None)
            if type(result) in (list, tuple):  # already materialised: nothing left to wait for
                for chunk in result:
                    self._sent += len(chunk)
                self._finish()
                return result
            file_wrapper = environ.get("wsgi.file_wrapper")
            if isinstance(file_wrapper, type) and isinstance(result, file_wrapper):
                # Keep the server's sendfile() path: the size is the declared Content-Length.
                self._sent = _declared_length(self._headers) or 0
                self._finish()
                return result
            self._iterable = result
            return self
        except Exception:
            recorder.internal_error()
            self._finish()
            return result

    # -- iteration by the server ---------------------------------------------------------------

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        req = self._req
        it = self._it
        if req is None:  # ended (a failure, or iterated again after the end)
            if it is None:
                it = self._it = iter(self._iterable)
            return next(it)
        token = _set(req)
        try:
            if it is None:
                it = self._it = iter(self._iterable)
            chunk = next(it, _END)
        except BaseException as exc:
            _reset(token)
            self.fail(exc)
            raise
        try:  # _reset, inlined
            _current.reset(token)
        except ValueError:  # a generator switched contexts under us: just clear ours
            _set(None)
        if chunk is _END:
            self._finish()
            raise StopIteration
        try:
            self._sent += len(chunk)
        except Exception:
            pass
        return chunk

    def close(self) -> None:
        close = getattr(self._iterable, "close", None)
        req = self._req
        if close is None or req is None:  # nothing to run, or the request ended (exhausted)
            if close is not None:
                close()
            if self._req is not None:
                self._finish()
            return
        token = _set(req)
        try:
            close()
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:
            if token is not None:
                _reset(token)
            self._finish()

    def __del__(self) -> None:
        # A server that drops the response without closing or exhausting it (not PEP 3333
        # compliant, but it happens: test clients, aborted connections) still ends the request.
        try:
            if self._req is not None:
                self._finish()
        except Exception:
            pass

    # -- the end -------------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        req = self._req
        if req is None:
            return
        try:
            req.status = 500
            req.error = type(exc).__name__
        except Exception:
            pass
        self._finish()

    def _finish(self) -> None:
        req, self._req = self._req, None
        if req is None:
            return
        try:
            req.resp_bytes = self._sent
            if _get_ident() != self._tid:
                req.cpu_start = None  # thread CPU time means nothing across threads
        except Exception:
            recorder.internal_error()
        recorder.end(req)
        if capture.on:
            capture.finish_wsgi(req, self._environ, self._tap)
        self._environ = self._tap = None


def _unrecorded(
    app: Callable[..., Any], environ: dict[str, Any], start_response: Callable[..., Any]
) -> Any:
    """A request not recorded here (one already runs in this context, or the agent is off)."""
    outer = _current.get()
    if outer is not None and not outer.endpoint and _flask_request is not None:
        # A Flask app inside a recorded request (mounted in Starlette, say): it names it.
        return app(environ, _NamingStartResponse(outer, start_response))
    return app(environ, start_response)


def _counted_write(body: Any, write: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """The legacy write() callable (PEP 3333) of a body (a _Body or _wsgi.Body), counted."""

    def counted_write(data: bytes) -> Any:
        try:
            body._sent += len(data)
        except Exception:
            pass
        return write(data)

    return counted_write


def _declared_length(headers: Any) -> int | None:
    """The Content-Length among a response's headers."""
    for name, value in headers or ():
        if str(name).lower() == "content-length":
            return content_length(value)
    return None


def _reset(token: Any) -> None:
    try:
        _current.reset(token)
    except ValueError:  # a generator switched contexts under us: just clear ours
        _current.set(None)


# ------------------------------------------------------------------------------------ Flask

_flask_connected = False
_flask_started_connected = False  # the request_started receiver (see _name_on_request_started)
_flask_lock = threading.Lock()
_on_request_started: Callable[..., None] | None = None
# Flask's request-context ContextVar (Flask >= 2.3), once connected: start_response reads the
# matched URL rule from it. None: not connected, or an older Flask (its request_started signal
# names the endpoint then).
_flask_request: Any = None
_endpoints: dict[tuple[str, str], str] = {}  # (method, URL rule) -> endpoint name


def _name_from_flask(req: recorder.ActiveRequest, ctx: Any) -> None:
    """Name ``req`` after the URL rule Flask matched in request context ``ctx`` (none matched:
    left unnamed, recorded as unmatched)."""
    rule = ctx.request.url_rule
    if rule is None:
        return
    key = (req.method, rule.rule)
    name = _endpoints.get(key)
    if name is None:
        if len(_endpoints) >= 10_000:
            _endpoints.clear()
        name = _endpoints[key] = endpoint(*key)
    req.endpoint = name


class _NamingStartResponse:
    """The server's start_response for a Flask app running inside a request recorded by
    another integration: names that request after Flask's URL rule."""

    __slots__ = ("outer", "start_response")

    def __init__(self, outer: recorder.ActiveRequest, start_response: Callable[..., Any]) -> None:
        self.outer = outer
        self.start_response = start_response

    def __call__(self, status: str, headers: Any, exc_info: Any = None) -> Any:
        try:
            ctx = _flask_request.get(None) if not self.outer.endpoint else None
            if ctx is not None:
                _name_from_flask(self.outer, ctx)
        except Exception:
            recorder.internal_error()
        if exc_info is None:
            return self.start_response(status, headers)
        return self.start_response(status, headers, exc_info)


def _name_on_request_started(app: Any) -> None:
    """Name requests from Flask's request_started signal too (once per process), when ``app``
    has a middleware on ``app.wsgi_app``: one that buffers the response calls the server's
    start_response after Flask popped its request context, where no URL rule can be read."""
    global _flask_started_connected
    if _flask_started_connected or "wsgi_app" not in getattr(app, "__dict__", ()):
        return
    try:
        with _flask_lock:
            if _flask_started_connected or _on_request_started is None:
                return
            from flask import signals

            signals.request_started.connect(_on_request_started, weak=False)
            _flask_started_connected = True
    except Exception:
        recorder.internal_error()


def connect_flask() -> None:
    """Take endpoint names and unhandled exceptions from Flask (once per process): the URL
    rule from the request context start_response runs in (the request_started signal on a
    Flask older than 2.3, or behind a middleware on ``app.wsgi_app``: see
    _name_on_request_started), the exception from the got_request_exception signal."""
    global _flask_connected, _flask_request, _flask_started_connected, _on_request_started
    if _flask_connected:
        return
    try:
        with _flask_lock:
            if _flask_connected:
                return
            from flask import globals as flask_globals
            from flask import signals

            request_var = getattr(flask_globals, "_cv_request", None)
            proxy = flask_globals.request

            def on_request_started(sender: Any, **extra: Any) -> None:
                req = _current.get()
                if req is None or req.endpoint:
                    return
                try:
                    rule = proxy.url_rule
                    if rule is not None:
                        req.endpoint = endpoint(req.method, rule.rule)
                except Exception:
                    recorder.internal_error()

            def on_exception(
                sender: Any, exception: BaseException | None = None, **extra: Any
            ) -> None:
                req = _current.get()
                if req is not None and exception is not None:
                    req.error = type(exception).__name__
                    # sent inside the request context: an exception that propagates never
                    # reaches start_response
                    ctx = request_var.get(None) if request_var is not None else None
                    if ctx is not None and not req.endpoint:
                        try:
                            _name_from_flask(req, ctx)
                        except Exception:
                            recorder.internal_error()

            if request_var is None:
                signals.request_started.connect(on_request_started, weak=False)
                _flask_started_connected = True
            signals.got_request_exception.connect(on_exception, weak=False)
            _on_request_started = on_request_started
            _flask_request = request_var
            _flask_connected = True
    except Exception:
        recorder.internal_error()


def patch_flask(module: ModuleType) -> None:
    """Record every Flask application: wrap ``Flask.__call__`` (outside any middleware the app
    put on ``app.wsgi_app``)."""
    cls = getattr(module, "Flask", None)
    if cls is None or getattr(cls.__call__, "_perfsleuth_original", None) is not None:
        return
    original = cls.__call__

    @functools.wraps(original)
    def __call__(self: Any, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if not _flask_started_connected:
            _name_on_request_started(self)
        return record_wsgi(original.__get__(self, type(self)), environ, start_response)

    __call__._perfsleuth_original = original  # type: ignore[attr-defined]
    # In C when it is there (_wsgi.FlaskCall: the same, without this Python frame and the bound
    # method a request); its attribute ``python`` is this one.
    cls.__call__ = __call__ if _c_wsgi is None else _c_wsgi.FlaskCall(original, __call__)
    connect_flask()


def unpatch_flask(module: ModuleType) -> None:
    cls = getattr(module, "Flask", None)
    original = getattr(cls.__call__, "_perfsleuth_original", None) if cls is not None else None
    if cls is not None and original is not None:
        cls.__call__ = original


def _load_c() -> Any:
    """agent/_wsgi.c, configured, when the accelerator is on and it was built; else None."""
    if not accel.on:
        return None
    try:
        from perfsleuth.agent import _wsgi  # type: ignore[attr-defined]

        _wsgi.configure(
            recorder=recorder, capture=capture, common=common, wsgi=sys.modules[__name__]
        )
    except Exception:
        return None
    return _wsgi


_c_wsgi: Any = _load_c()
# What PerfsleuthWSGI and the Flask patch call (a global looked up at each request): the C
# version when it is there (the same, case for case), else python_record_wsgi.
record_wsgi: Callable[..., Any] = _c_wsgi.record_wsgi if _c_wsgi is not None else python_record_wsgi

__all__ = ["PerfsleuthWSGI", "patch_flask", "record_wsgi"]
