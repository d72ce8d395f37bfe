"""ASGI: ``PerfsleuthASGI(app)`` records every HTTP request of an ASGI application.

One module of ~700 lines: the recorder, the route-template resolution and the CPU meter all
work on one request's scope and task, and the C accelerator replaces parts of them by name.
With it, the recording ``__call__`` is agent/_asgi.c's ``Recording``: its call returns an
awaitable without a Python frame that does what ``_python_recording``'s coroutine (the
reference, kept for ``PERFSLEUTH_SPEEDUPS=0`` and tested against it: tests/test_asgi_c.py) and
``_finish`` do, the route name's cache hit and the capture's "nothing to keep" included; the
rare cases call back into the functions here.

Only ``http`` scopes are recorded (lifespan and websocket pass straight through). Per request:
method and path (references into the scope), the status from ``http.response.start``, the bytes
of request and response bodies as they pass through ``receive``/``send``, and the two configured
identity headers. Nothing else is copied.

Endpoints are route templates, worked out after the app returned (nothing is done while
routing). The matched route is ``scope["route"]`` (set by Starlette's router and by FastAPI's
API routes) or, for what FastAPI's router leaves out of it (plain Starlette routes, mounts), the
route whose endpoint is ``scope["endpoint"]``. Its template is joined with the templates of the
Mounts above it, found by walking the route tree once per router (so a mount written
``/t/{tenant}`` stays a template), and, for FastAPI's ``include_router``, with the inclusion
prefix FastAPI keeps in ``scope["fastapi"]["effective_route_context"]``. A framework mounted
inside (Flask through a2wsgi, Django) names the endpoint itself; the mount path is put in front.
No route (404, scanners) gives ``"<METHOD> <unmatched>"``: never the raw path, and methods
outside the standard set are ``OTHER``.

``patch_starlette`` wraps ``Starlette.__call__`` so every Starlette/FastAPI application records
itself (FastAPI overrides ``build_middleware_stack`` without calling Starlette's, but its
``__call__`` always goes through Starlette's). Mounted sub-applications and explicit wrapping on
top of the patch do not double-record: an inner recorder sees a request in progress and stands by.

CPU time (``req.cpu_ns``), for the requests in the CPU sample (PERFSLEUTH_CPU_SAMPLE,
recorder.cpu_sampled; the others keep None and read no clock): the loop thread's CPU clock
across each step of the request's own task (the app's awaitable is driven through a
:class:`CpuMeter`, which times each step it forwards), plus the worker threads' CPU while its
sync code runs in a thread pool (agent.instrument.threads). A route run in a child task
(Starlette's ``BaseHTTPMiddleware`` runs the rest of the app in one) is metered in that task
too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import re
import sys
import time
import types
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from types import ModuleType
from typing import Any

from perfsleuth.agent import accel, capture, recorder, watchdog
from perfsleuth.agent.frameworks.common import (
    content_length,
    endpoint,
    unmatched,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class PerfsleuthASGI:
    """ASGI middleware recording each HTTP request; attribute access falls through to the app."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:
        if name == "app":
            raise AttributeError(name)
        return getattr(self.app, name)

    def __repr__(self) -> str:
        return f"PerfsleuthASGI({self.app!r})"


class SendTap:
    """The send callable handed to the app: what the response said on its way to the server
    (status, headers, body bytes, whether it was complete), then the server's send. The C
    accelerator has the same (agent/_speedups.c), without a Python frame per message."""

    __slots__ = ("complete", "headers", "pathsend", "send", "sent", "status")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 0  # 0: no response started
        self.headers: Any = None
        self.sent = 0
        self.complete = False  # the last body message went out
        self.pathsend = False  # the body was sent by the server from a file

    def __call__(self, message: Message) -> Awaitable[None]:
        # Not a coroutine of its own: it returns the server's send awaitable, which the app
        # awaits (one coroutine object less per message).
        try:
            t = message["type"]
            if t == "http.response.body":
                body = message.get("body")
                if body:
                    self.sent += len(body)
                if not message.get("more_body", False):
                    self.complete = True
            elif t == "http.response.start":
                self.status = int(message["status"])
                self.headers = message.get("headers")
            elif t in ("http.response.pathsend", "http.response.zerocopy"):
                self.pathsend = True
                if t == "http.response.pathsend" or not message.get("more_body", False):
                    self.complete = True
        except Exception:
            recorder.internal_error()
        return self.send(message)

    def declared_length(self) -> int | None:
        for name, value in self.headers or ():
            if bytes(name).lower() == b"content-length":
                return content_length(bytes(value).decode("latin-1"))
        return None


_SendTap: Any = accel.pick("SendTap", SendTap)


class _AsgiRequest(recorder.ActiveRequest):
    """A request recorded at the ASGI layer: the request, plus its exchange with the server
    (the receive wrapper, the send tap) (one object per request)."""

    __slots__ = ("_receive", "out", "received", "tap")

    _receive: Receive
    out: SendTap  # the send handed to the app
    received: int
    tap: capture.BodyTap | None  # the body, for a possible capture

    async def receive(self) -> Message:
        message = await self._receive()
        try:
            if message.get("type") == "http.request":
                body = message.get("body")
                if body:
                    self.received += len(body)
                    if capture.on:
                        tap = self.tap
                        if tap is None:
                            tap = self.tap = capture.BodyTap()
                        tap.add(body)
        except Exception:
            recorder.internal_error()
        return message


class CpuMeter:
    """``await CpuMeter(req, awaitable)``: awaits ``awaitable``, adding the thread's CPU time
    of every step it forwards (send, throw) to ``req.cpu_ns``; the task's other steps (the
    server's code) and the loop's other tasks are not counted. The sampler's walk down a
    task's await chain sees it as the coroutine it drives (``cr_frame``, ``cr_await``). The C
    accelerator has the same (agent/_speedups.c).

    The thread's CPU clock is a system call (0.4-1.3 µs here), the wall clock is not (vDSO,
    ~40 ns), and a FastAPI request takes ~7 steps: a step reads the CPU clock when it starts
    and, only when it lasted ``SHORT_STEP_NS`` or more, when it ends; a shorter step counts
    its wall time (too short to have waited for the CPU or blocked in a way that matters: a
    preemption or a blocking call makes a step longer than that, and it is then timed by the
    CPU clock)."""

    __slots__ = ("aw", "it", "req")

    def __init__(self, req: recorder.ActiveRequest, aw: Any) -> None:
        if type(aw) is _Coroutine or type(aw) is _Generator:
            it = aw
        else:
            get = getattr(type(aw), "__await__", None)
            if get is None:  # what ``await aw`` would raise
                raise TypeError(f"object {type(aw).__name__} can't be used in 'await' expression")
            it = get(aw)
        self.req = req
        self.aw = aw
        self.it = it

    def __await__(self) -> CpuMeter:
        return self

    def __iter__(self) -> CpuMeter:
        return self

    def __next__(self) -> Any:
        c0, w0 = _thread_time(), _perf()
        try:
            return self.it.send(None)
        finally:
            self._add(c0, w0)

    def send(self, value: Any) -> Any:
        c0, w0 = _thread_time(), _perf()
        try:
            return self.it.send(value)
        finally:
            self._add(c0, w0)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        c0, w0 = _thread_time(), _perf()
        try:
            # the exception itself: the three-argument form is deprecated from 3.12
            return self.it.throw(_thrown(typ, val, tb))
        finally:
            self._add(c0, w0)

    def _add(self, c0: int, w0: int) -> None:
        used = _perf() - w0
        if used >= SHORT_STEP_NS:
            used = _thread_time() - c0
        self.req.cpu_ns += used  # type: ignore[operator]

    def close(self) -> None:
        self.it.close()

    @property
    def cr_frame(self) -> Any:
        return getattr(self.aw, "cr_frame", None)

    @property
    def cr_await(self) -> Any:
        return getattr(self.aw, "cr_await", None)


def _thrown(typ: Any, val: Any, tb: Any) -> Any:
    """The exception ``throw(typ, val, tb)`` raises, as a generator's throw makes it: ``val``
    when it is an instance of ``typ``, else ``typ`` called with it (None: no arguments, a
    tuple: its items); an instance for ``typ`` takes no value."""
    if val is None and tb is None:
        return typ
    if isinstance(typ, type) and issubclass(typ, BaseException):
        if isinstance(val, typ):
            exc = val
        elif val is None:
            exc = typ()
        elif isinstance(val, tuple):
            exc = typ(*val)
        else:
            exc = typ(val)
    elif isinstance(typ, BaseException):
        if val is not None:
            raise TypeError("instance exception may not have a separate value")
        exc = typ
    else:
        raise TypeError("exceptions must be classes or instances deriving from BaseException")
    return exc if tb is None else exc.with_traceback(tb)


SHORT_STEP_NS = 50_000
_Coroutine = types.CoroutineType
_Generator = types.GeneratorType  # a @types.coroutine generator is awaited as it is
_thread_time = time.thread_time_ns
_perf = time.perf_counter_ns
_CpuMeter: Any = accel.pick("CpuMeter", CpuMeter)

_begin = recorder.begin
_end = recorder.end
_cpu_sampled = recorder.cpu_sampled
_current_get = recorder.current_get
# {loop: its running task} as asyncio keeps it (3.11-3.13): read directly, with the loop of each
# thread remembered, it gives the current task without asyncio.current_task(), whose
# get_running_loop() makes a getpid() system call every time.
_running_tasks: dict[Any, Any] | None = getattr(asyncio.tasks, "_current_tasks", None)
if type(_running_tasks) is not dict:
    _running_tasks = None
_loop_of: dict[int, Any] = {}  # thread ident -> the event loop last seen running on it


def _python_recording(inner: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """An ASGI ``__call__(self, scope, receive, send)`` recording each http request around
    ``inner(self, scope, receive, send)``: one coroutine layer, whatever wraps what (each layer
    is resumed at every step of the request). Everything that can wait (header values, the
    endpoint's name once per route) is left to the writer thread or remembered: this runs on
    every request, cold in the CPU's caches. The reference of agent/_asgi.c's Recording
    (:func:`_recording`)."""

    async def __call__(self: Any, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await inner(self, scope, receive, send)
            return
        try:
            req: _AsgiRequest | None = _begin(  # type: ignore[assignment]  # cls says so
                "web", scope.get("method") or "", scope.get("path") or "/", cls=_AsgiRequest
            )
        except Exception:
            req = None
        if req is None:
            await inner(self, scope, receive, send)
            return
        try:
            req._receive = receive
            req.received = 0
            req.tap = None
            # CPU time for the requests in the sample (recorder.cpu_sampled): the others read
            # no thread clock (no meter; the hand-off to a worker and the child task's meter
            # skip a request whose cpu_ns is None)
            metered = _cpu_sampled(req)
            req.cpu_ns = 0 if metered else None
            out = req.out = _SendTap(send)
        except Exception:  # the exchange cannot be tapped: it ends as it is, the app runs
            recorder.internal_error()
            _end(req)
            await inner(self, scope, receive, send)
            return
        except BaseException:  # KeyboardInterrupt, SystemExit: not the agent's; it ends
            _end(req)
            raise
        try:
            req.headers = scope.get("headers")
            # the request's task, for the sampler and the loop watchdog
            loop = _loop_of.get(req.thread)
            task = None if loop is None or _running_tasks is None else _running_tasks.get(loop)
            req.task = task if task is not None else _new_loop(req.thread)
        except Exception:  # the user, tenant or samples are lost, not the request
            recorder.internal_error()
        except BaseException:
            _end(req)
            raise
        try:
            app = inner(self, scope, req.receive, out)
            await (_CpuMeter(req, app) if metered else app)
        except BaseException as exc:
            try:
                if not out.complete or not out.status:
                    req.status = 500
                req.error = type(exc).__name__
            except Exception:
                pass
            raise
        finally:
            _finish(req, scope)

    return __call__


def _new_loop(thread: int) -> Any:
    """The current task, on a loop not seen on this thread before: remember the loop and have
    the watchdog watch it."""
    loop = asyncio.get_running_loop()
    if len(_loop_of) > 1000:
        _loop_of.clear()
    _loop_of[thread] = loop
    watchdog.watch_current_loop()
    return asyncio.current_task(loop)


def _load_c() -> Any:
    """agent/_asgi.c when the accelerator is on and it was built; else None. It is configured
    at the end of this module (:func:`_configure_c`): it remembers the functions it does in C
    as they are bound then."""
    if not accel.on:
        return None
    try:
        from perfsleuth.agent import _asgi  # type: ignore[attr-defined]
    except Exception:
        return None
    return _asgi


_c_asgi: Any = _load_c()
# How a C Recording calls what it records (_asgi.c's HOW_*).
_HOW_CALL, _HOW_APP, _HOW_DIRECT = 0, 1, 2


def _recording(
    inner: Callable[..., Awaitable[None]],
    how: int = _HOW_CALL,
    python: Callable[..., Awaitable[None]] | None = None,
) -> Callable[..., Awaitable[None]]:
    """:func:`_python_recording` (or ``python``, the same made by the caller), or the same in C
    when the accelerator is there: agent/_asgi.c's Recording, whose call returns an awaitable
    without a Python frame (``.python`` is the Python version). ``how``: the C version calls
    ``inner(self, scope, receive, send)`` (_HOW_CALL), ``self.app(scope, receive, send)``
    (_HOW_APP) or ``self(scope, receive, send)`` (_HOW_DIRECT); ``inner`` does the same."""
    if python is None:
        python = _python_recording(inner)
    if _c_asgi is None:
        return python
    try:
        rec = _c_asgi.Recording(inner, python, how)
        # what servers and frameworks ask of an ASGI app's __call__ (uvicorn's interface
        # detection, Starlette's is_async_callable): a coroutine function, as python is
        rec._is_coroutine = getattr(asyncio.coroutines, "_is_coroutine", None)
        mark = getattr(inspect, "markcoroutinefunction", None)  # 3.12+
        if mark is not None:
            mark(rec)
        return rec  # type: ignore[no-any-return]
    except Exception:
        recorder.internal_error()
        return python


# record_asgi(app, scope, receive, send): run ``app`` for a scope, recording an http request
# (unless one is already being recorded: mounted apps, explicit wrapping on top of the patch).
record_asgi = _recording(lambda app, scope, receive, send: app(scope, receive, send), _HOW_DIRECT)
PerfsleuthASGI.__call__ = _recording(  # type: ignore[method-assign]
    lambda self, scope, receive, send: self.app(scope, receive, send), _HOW_APP
)


def _running_task(thread: int) -> Any:
    loop = _loop_of.get(thread)
    return None if loop is None or _running_tasks is None else _running_tasks.get(loop)


class _ChildTaskMeter:
    """The app below a ``BaseHTTPMiddleware``, which runs it in a child task of the request's:
    its steps are metered there (the request's own task meters only its own steps)."""

    __slots__ = ("app",)

    def __init__(self, app: Any) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:
        if name == "app":
            raise AttributeError(name)
        return getattr(self.app, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "app":
            object.__setattr__(self, name, value)
        else:  # the middleware's code sets what it means to set on the app below
            setattr(self.app, name, value)

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Any:
        aw = self.app(scope, receive, send)
        try:
            req = _current_get()
            if req is None or req.cpu_ns is None or _running_task(req.thread) is req.task:
                return aw
            return _CpuMeter(req, aw)
        except Exception:
            recorder.internal_error()
            return aw


def _finish(req: _AsgiRequest, scope: Scope) -> None:
    try:
        # Bytes read by the app; a body the app never read counts by its declared size (the
        # writer reads Content-Length from req.headers when req_bytes is None).
        if req.received:
            req.req_bytes = req.received
        out = req.out
        if req.status is None:  # not set to 500 by an exception
            req.status = out.status or None
        if out.pathsend:
            req.resp_bytes = out.sent + (SendTap.declared_length(out) or 0)
        else:
            req.resp_bytes = out.sent
        if not req.endpoint:
            req.endpoint = _route_name(scope, req.method, req.status)
        else:  # named by a framework mounted inside (Flask via a2wsgi, Django): add the mount
            req.endpoint = _under_mount(scope, req.endpoint)
    except Exception:
        recorder.internal_error()
        if not req.endpoint:
            req.endpoint = unmatched(req.method)
    req._receive = req.out = None  # type: ignore[assignment]  # the writer needs neither
    _end(req)
    if capture.on:
        capture.finish_asgi(req, scope, req.tap)


# (id(route), id(FastAPI's route context), id(router), method) -> (route, context, router,
# endpoint name) of plain matched routes: naming one walks mounts and FastAPI's inclusion
# contexts, the same every time for the same objects.
_names: dict[tuple[int, int, int, str], tuple[Any, Any, Any, str]] = {}


def _route_name(scope: Scope, method: str, status: int | None) -> str:
    """:func:`route_endpoint`, remembered for a matched route that is not a mount."""
    route = scope.get("route")
    fastapi_scope = scope.get("fastapi")
    ctx = fastapi_scope.get("effective_route_context") if type(fastapi_scope) is dict else None
    router = scope.get("router")
    key = (id(route), id(ctx), id(router), method)
    hit = _names.get(key)
    if hit is not None and hit[0] is route and hit[1] is ctx and hit[2] is router:
        return hit[3]
    name = route_endpoint(scope, method, status)
    if route is not None and not _is_mount(route):  # a mount's name depends on the status
        if len(_names) >= MAX_ENTRIES:
            _names.clear()
        _names[key] = (route, ctx, router, name)
    return name


# ------------------------------------------------------------------------- Starlette routes


class _RouteIndex:
    """The route tree of one top router, walked once: every route's mount prefix template,
    and the routes by endpoint (FastAPI's router does not put plain Starlette routes and mounts
    in ``scope["route"]``; their ``scope["endpoint"]`` finds them)."""

    __slots__ = ("by_endpoint", "prefixes", "rebuilds", "router")

    def __init__(self, router: Any, rebuilds: int = 0) -> None:
        self.router = router
        self.rebuilds = rebuilds
        self.prefixes: dict[int, tuple[Any, str]] = {}  # id(route) -> (route, prefix)
        # id(endpoint) -> (endpoint, [routes]): one function can serve several routes
        self.by_endpoint: dict[int, tuple[Any, list[Any]]] = {}
        self._walk(getattr(router, "routes", None) or (), "", 0, set())

    def _walk(self, routes: Any, prefix: str, depth: int, seen: set[int]) -> None:
        if depth > 16:
            return
        for route in list(routes):
            self.prefixes.setdefault(id(route), (route, prefix))
            if id(route) in seen:
                continue
            seen.add(id(route))
            try:
                mount = _is_mount(route)
                target = getattr(route, "app" if mount else "endpoint", None)
                if target is not None:
                    self.by_endpoint.setdefault(id(target), (target, []))[1].append(route)
                if mount:
                    self._walk(route.routes or (), prefix + str(route.path), depth + 1, seen)
                    continue
                # FastAPI's included routers and Starlette's Host routes keep the prefix.
                sub = getattr(route, "original_router", None)
                children = getattr(sub, "routes", None) if sub is not None else None
                if children is None and hasattr(route, "host") and hasattr(route, "routes"):
                    children = route.routes
                if children:
                    self._walk(children, prefix, depth + 1, seen)
            except Exception:
                recorder.internal_error()


# id(top router) -> its index
_indexes: dict[int, _RouteIndex] = {}
MAX_ROUTERS = 64
MAX_REBUILDS = 32  # walks of one router after its first (routes added at run time)
MAX_ENTRIES = 10_000


def _index(router: Any, fresh: bool = False) -> _RouteIndex:
    idx = _indexes.get(id(router))
    if idx is not None and idx.router is router:
        if not fresh or idx.rebuilds >= MAX_REBUILDS:
            return idx
        rebuilds = idx.rebuilds + 1
    else:
        rebuilds = 0
    if len(_indexes) >= MAX_ROUTERS:
        _indexes.clear()
    idx = _indexes[id(router)] = _RouteIndex(router, rebuilds)
    return idx


def _matched_route(scope: Scope) -> Any:
    route = scope.get("route")
    endpoint_ = scope.get("endpoint")
    if endpoint_ is None:
        return route
    if route is not None and not (_is_mount(route) and endpoint_ is not route.app):
        return route
    router = scope.get("router")
    if router is None:
        return route
    hit = _index(router).by_endpoint.get(id(endpoint_))
    if hit is None or hit[0] is not endpoint_:
        idx = _index(router, fresh=True)
        hit = idx.by_endpoint.get(id(endpoint_))
        if hit is None or hit[0] is not endpoint_:
            hit = (endpoint_, [])  # not in the tree: remember, do not walk again
            if len(idx.by_endpoint) < MAX_ENTRIES:
                idx.by_endpoint[id(endpoint_)] = hit
    candidates = hit[1]
    if not candidates:
        return route
    if len(candidates) > 1:
        # Told apart by the mounts the path went through and the path below them.
        root = str(scope.get("root_path") or "")
        consumed = root[len(str(scope.get("app_root_path") or "")) :]
        rest = str(scope.get("path") or "")[len(root) :] or "/"
        idx = _index(router)
        for candidate in candidates:
            regex = getattr(candidate, "path_regex", None)
            prefix = idx.prefixes.get(id(candidate), (None, ""))[1]
            if regex is not None and regex.match(rest) and _prefix_regex(prefix).match(consumed):
                return candidate
    return candidates[0]


_prefix_regexes: dict[str, Any] = {}


def _prefix_regex(prefix: str) -> Any:
    regex = _prefix_regexes.get(prefix)
    if regex is None:
        from starlette.routing import compile_path

        regex = compile_path(prefix)[0] if prefix else re.compile("^$")
        if len(_prefix_regexes) < MAX_ENTRIES:
            _prefix_regexes[prefix] = regex
    return regex


def route_endpoint(scope: Scope, method: str, status: int | None = None) -> str:
    """``"<METHOD> <template>"`` of the route Starlette/FastAPI matched, or unmatched."""
    route = _matched_route(scope)
    if route is None or (status == 404 and _is_mount(route)):
        # no route at all, or a mounted app that found none of its own
        return unmatched(method)
    template = None
    fastapi_scope = scope.get("fastapi")
    if isinstance(fastapi_scope, dict):
        ctx = fastapi_scope.get("effective_route_context")
        if ctx is not None and (
            getattr(ctx, "original_route", None) is route
            or getattr(ctx, "starlette_route", None) is route
        ):
            inner = getattr(ctx, "starlette_route", None)
            template = (getattr(inner, "path", None) if inner is not None else None) or getattr(
                ctx, "path", None
            )
    if not template:
        template = getattr(route, "path", None)
    if not isinstance(template, str):
        return unmatched(method)
    if _is_mount(route):
        template = template + "/{path}"  # a mounted app matched but did no routing of its own
    return endpoint(method, _mount_prefix(scope, route) + template)


def _under_mount(scope: Scope, name: str) -> str:
    route = _matched_route(scope)
    if route is None or not _is_mount(route):
        return name
    method, _, template = name.partition(" ")
    if not template.startswith("/"):
        return name  # "<unmatched>" stays unmatched
    return f"{method} {_mount_prefix(scope, route)}{route.path}{template}"


def _is_mount(route: Any) -> bool:
    fmt = getattr(route, "path_format", None)
    return isinstance(fmt, str) and fmt.endswith("/{path}") and hasattr(route, "routes")


def _mount_prefix(scope: Scope, route: Any) -> str:
    router = scope.get("router")
    if router is None:
        return ""
    idx = _index(router)
    hit = idx.prefixes.get(id(route))
    if hit is None or hit[0] is not route:
        idx = _index(router, fresh=True)  # routes added after the first request: look again
        hit = idx.prefixes.get(id(route))
        if hit is None or hit[0] is not route:
            # Not reachable through the route tree (an opaque mounted app): fall back to the
            # literal prefix the mounts consumed. Remembered, so the walk is not repeated.
            root = str(scope.get("root_path") or "")
            literal = root[len(str(scope.get("app_root_path") or "")) :]
            hit = (route, literal)
            if len(idx.prefixes) < MAX_ENTRIES:
                idx.prefixes[id(route)] = hit
    return hit[1]


# ------------------------------------------------------------------------------------ patch


def patch_starlette(module: ModuleType) -> None:
    """Record every Starlette/FastAPI application by wrapping ``Starlette.__call__``."""
    cls = getattr(module, "Starlette", None)
    if cls is None or getattr(cls.__call__, "_perfsleuth_original", None) is not None:
        return
    original = cls.__call__
    python = functools.wraps(original)(_python_recording(original))
    python._perfsleuth_original = original  # type: ignore[attr-defined]
    __call__ = _recording(original, _HOW_CALL, python)
    if __call__ is not python:  # the C Recording: the same names as the Python version
        functools.wraps(original)(__call__)
        __call__._perfsleuth_original = original  # type: ignore[attr-defined]
    cls.__call__ = __call__
    try:
        import starlette.middleware.base as base

        _patch_base_middleware(base)
    except Exception:
        recorder.internal_error()


def _patch_base_middleware(module: ModuleType) -> None:
    cls = getattr(module, "BaseHTTPMiddleware", None)
    if cls is None or getattr(cls.__init__, "_perfsleuth_original", None) is not None:
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, app: Any, *args: Any, **kwargs: Any) -> None:
        original(self, app, *args, **kwargs)
        if getattr(self, "app", None) is app:
            self.app = _ChildTaskMeter(app)

    __init__._perfsleuth_original = original  # type: ignore[attr-defined]
    cls.__init__ = __init__


def patch_uvicorn(module: ModuleType) -> None:
    """Write everything before uvicorn re-raises a SIGTERM it shut down for.

    After a graceful shutdown uvicorn restores the previous handlers and raises the captured
    signal again so the process ends "by the signal"; for SIGTERM that is the default action,
    which kills the process without running ``atexit`` (so without the agent's final flush).
    Flushing and closing the segment at the end of ``Server.capture_signals`` (after the server
    has stopped, before the signal is re-raised) keeps those last requests.
    """
    cls = getattr(module, "Server", None)
    original = getattr(cls, "capture_signals", None)
    if cls is None or original is None or getattr(original, "_perfsleuth_original", None):
        return

    @contextlib.contextmanager
    @functools.wraps(original)
    def capture_signals(self: Any) -> Iterator[None]:
        with original(self):
            try:
                yield
            finally:
                if getattr(self, "_captured_signals", None):
                    _shutdown_agent()

    capture_signals._perfsleuth_original = original  # type: ignore[attr-defined]
    cls.capture_signals = capture_signals


def _shutdown_agent() -> None:
    try:
        from perfsleuth.agent import shipper

        shipper.shutdown()
    except Exception:
        pass


def unpatch_starlette(module: ModuleType) -> None:
    cls = getattr(module, "Starlette", None)
    original = getattr(cls.__call__, "_perfsleuth_original", None) if cls is not None else None
    if cls is not None and original is not None:
        cls.__call__ = original
    base = sys.modules.get("starlette.middleware.base")
    mw = getattr(base, "BaseHTTPMiddleware", None)
    init = getattr(getattr(mw, "__init__", None), "_perfsleuth_original", None)
    if mw is not None and init is not None:
        mw.__init__ = init


__all__ = ["PerfsleuthASGI", "patch_starlette", "patch_uvicorn", "record_asgi", "route_endpoint"]


def _configure_c() -> None:
    """agent/_asgi.c reads this module's, recorder's and capture's globals, and does _finish,
    _route_name, capture.reason and capture.finish_asgi in C while each is still the function
    bound now. Not configured, its Recordings call their Python version."""
    if _c_asgi is None:
        return
    try:
        _c_asgi.configure(recorder=recorder, capture=capture, asgi=sys.modules[__name__])
    except Exception:
        recorder.internal_error()


_configure_c()
