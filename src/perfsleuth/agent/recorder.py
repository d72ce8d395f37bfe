"""The request-path half of the agent: what is recorded while a request runs.

Everything here runs inside application requests, so it only stores integers and references
(timestamps, code objects, the statement string) and never raises: any internal error is
counted (``stats["internal_errors"]``) and swallowed. Encoding happens on the writer thread
(:mod:`perfsleuth.agent.shipper`).

Instrumentation of a client library follows one pattern::

    call = recorder.start_call("db", "postgresql", sql, params)   # None when not in a request
    try:
        result = original(...)
    except BaseException as exc:
        if call is not None:
            call.error = type(exc).__name__
        raise
    finally:
        if call is not None:
            call.finish()
"""

from __future__ import annotations

import contextvars
import functools
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from perfsleuth.agent import stacks

_perf = time.perf_counter_ns
_getframe = sys._getframe
_code_kinds = stacks._kind
_MAX_DEPTH = stacks.MAX_DEPTH
_getrandbits = random.getrandbits  # reseeded in forked children by the random module itself
_get_ident = threading.get_ident

# Requests in flight, by id(request): read by the sampler, the loop watchdog and the GC hook
# on their own threads (iterate over a list() copy: the dict changes under them).
inflight: dict[int, ActiveRequest] = {}

_current: contextvars.ContextVar[ActiveRequest | None] = contextvars.ContextVar(
    "perfsleuth_request", default=None
)

# Counters shared with the shipper; plain ints mutated under the GIL (approximate is fine).
stats: dict[str, int] = {
    "requests_recorded": 0,
    "calls_dropped": 0,
    "internal_errors": 0,
}

MAX_ATTRS = 64
MAX_ATTR_CHARS = 1024

# Set by the shipper when the agent starts; None means "agent not started": record nothing.
_sink: Callable[[ActiveRequest], None] | None = None
_max_calls = 20000
_stacks_per_site = 1


def configure(
    sink: Callable[[ActiveRequest], None] | None, *, max_calls: int, stacks_per_site: int
) -> None:
    global _sink, _max_calls, _stacks_per_site
    _sink = sink
    _max_calls = max_calls
    _stacks_per_site = max(1, stacks_per_site)


def internal_error() -> None:
    stats["internal_errors"] += 1


class Call:
    """One outbound call (DB statement, HTTP request, cache command) inside a request.

    Made by :func:`start_call` without an ``__init__`` (``object.__new__`` and slot stores,
    measured at half the instructions of calling a Python ``__init__``), and with the fields
    most calls leave empty (HTTP status, bytes, cache hit, pool wait, error, driver
    extras) in one dict, ``more``, created by the first of them set: the writer reads them
    only when it exists."""

    __slots__ = (
        "end",
        "kind",
        "more",
        "params",
        "ph",
        "rows",
        "stack",
        "start",
        "system",
        "target",
    )

    kind: str  # "db" | "http" | "cache"
    system: str  # "sqlite", "postgresql", "mysql", "redis", "memcached", "http"
    target: Any  # db: the SQL text; http: (method, url); cache: (command, key)
    # Bound parameters are never stored, only hashed (to spot the same query with the same
    # values twice). A tuple is hashed on the request path (~0.1 µs) so the request does not
    # keep the application's values alive; anything else is hashed by the writer.
    ph: int | None
    params: Any
    start: int
    end: int  # 0 while unfinished
    rows: int | None
    # flat (code, where, ...) of stacks.capture; its first application frame is the call site
    stack: tuple[Any, ...] | None
    more: dict[str, Any] | None

    def finish(self) -> None:
        self.end = _perf()

    def _get(self, name: str) -> Any:
        more = self.more
        return None if more is None else more.get(name)

    def _set(self, name: str, value: Any) -> None:
        more = self.more
        if more is None:
            more = self.more = {}
        more[name] = value

    bytes = property(lambda c: c._get("bytes"), lambda c, v: c._set("bytes", v))
    status = property(lambda c: c._get("status"), lambda c, v: c._set("status", v))  # HTTP
    hit = property(lambda c: c._get("hit"), lambda c, v: c._set("hit", v))  # cache hit / miss
    wait = property(lambda c: c._get("wait"), lambda c, v: c._set("wait", v))  # pool wait, ns
    error = property(lambda c: c._get("error"), lambda c, v: c._set("error", v))  # class name
    extra = property(lambda c: c._get("extra"), lambda c, v: c._set("extra", v))


_new = object.__new__


class ActiveRequest:
    """A request (or background task) in flight; handed to the writer when it ends."""

    __slots__ = (
        "attrs",
        "calls",
        "calls_dropped",
        "cpu_ns",
        "cpu_start",
        "end",
        "endpoint",
        "error",
        "gc_count",
        "gc_ns",
        "keep",
        "kind",
        "method",
        "path",
        "req_bytes",
        "resp_bytes",
        "sites",
        "start",
        "start_wall",
        "status",
        "tags",
        "task",
        "tenant",
        "thread",
        "token",
        "trace_id",
        "user",
        "worker",
    )

    def __init__(self, kind: str, method: str, path: str) -> None:
        self.trace_id = _getrandbits(64) or 1
        self.start_wall = time.time_ns()
        self.start = _perf()
        self.end = 0
        self.cpu_start: int | None = None
        self.cpu_ns: int | None = None
        self.kind = kind
        self.method = method
        self.path = path
        self.endpoint = ""
        self.status: int | None = None
        self.error: str | None = None
        self.req_bytes: int | None = None
        self.resp_bytes: int | None = None
        self.user: str | None = None
        self.tenant: str | None = None
        # Created on first use: every object a request keeps alive until the writer takes it
        # counts towards the garbage collector's next collection.
        self.attrs: dict[str, Any] | None = None
        self.tags: dict[str, Any] | None = None
        self.calls: list[Call] = []
        self.calls_dropped = 0
        # (target, id(site code), site line) -> (stack, times captured)
        self.sites: dict[Any, tuple[Any, int]] = {}
        self.token: contextvars.Token[ActiveRequest | None] | None = None
        # Where the request's code runs, for the sampler and the loop watchdog: its thread
        # (the event loop's for async requests), its asyncio task, and a worker thread while
        # a sync endpoint runs in a thread pool.
        self.thread = _get_ident()
        self.task: Any = None
        self.worker: int | None = None
        self.gc_ns = 0  # time in garbage collections while in flight (agent.gcwatch)
        self.gc_count = 0
        self.keep: str | None = None  # why to keep a replayable capture (agent.capture)


def current() -> ActiveRequest | None:
    return _current.get()


def begin(
    kind: str, method: str = "", path: str = "", *, cpu: bool = False
) -> ActiveRequest | None:
    """Start recording a request in the current context. None when the agent is off or when a
    request is already being recorded here (nested frameworks record the outer one only)."""
    if _sink is None or _current.get() is not None:
        return None
    try:
        req = ActiveRequest(kind, method, path)
        if cpu:
            req.cpu_start = time.thread_time_ns()
        req.token = _current.set(req)
        inflight[id(req)] = req
        return req
    except Exception:
        internal_error()
        return None


def end(req: ActiveRequest) -> None:
    """Finish ``req``: duration, context reset, hand-off to the writer. Never raises."""
    try:
        req.end = _perf()
        inflight.pop(id(req), None)
        if req.cpu_start is not None:
            req.cpu_ns = time.thread_time_ns() - req.cpu_start
        if req.token is not None:
            try:
                _current.reset(req.token)
            except ValueError:  # ended from another context: just clear ours
                _current.set(None)
            req.token = None
        req.sites.clear()  # the stack cache is only for the request's lifetime
        stats["requests_recorded"] += 1
        sink = _sink
        if sink is not None:
            sink(req)
    except Exception:
        internal_error()


def start_call(kind: str, system: str, target: Any, params: Any = None, up: int = 1) -> Call | None:
    """Record the start of an outbound call from the current request (None outside one).

    ``up``: the frame the call comes from, counted from the caller of ``start_call``; an
    instrumentation wrapper passes 2 (its own caller): ``sys._getframe`` makes a frame object
    for the frame it returns, and the wrapper's would be a new one at every call."""
    req = _current.get()
    if req is None:
        return None
    try:
        calls = req.calls
        if len(calls) >= _max_calls:
            req.calls_dropped += 1
            stats["calls_dropped"] += 1
            return None
        call = _new(Call)
        call.kind = kind
        call.system = system
        call.target = target
        call.params = call.ph = call.rows = call.more = None
        call.end = 0
        if type(params) is tuple:
            if params:
                try:
                    call.ph = hash(params)
                except Exception:
                    call.params = params
        elif params is not None:
            call.params = params
        # The call site: the first application frame above us (else the first frame that is
        # not the agent's). Inlined, because it runs for every call and a Python function
        # call costs ~80 ns.
        frame = _getframe(up)
        f: Any = frame
        kinds = _code_kinds
        leaf = site = None
        depth = 0
        while f is not None and depth < _MAX_DEPTH:
            code = f.f_code
            hit = kinds.get(id(code))
            k = hit[1] if hit is not None else stacks.classify(code)
            if k:
                site = code
                break
            if k is not None and leaf is None:
                leaf = code
                leaf_frame = f
            f = f.f_back
            depth += 1
        # The stack of a call site is captured for its first occurrences in the request only:
        # an N+1 loop repeats the same stack thousands of times.
        # ids, not code objects: hashing a code object is not cached (see stacks.classify);
        # the stack kept in the entry holds the code, so its id stays unique while cached.
        if site is not None:
            key = (target if type(target) is str else kind, id(site), f.f_lasti)
        elif leaf is not None:
            key = (target if type(target) is str else kind, id(leaf), leaf_frame.f_lasti)
        else:
            key = (target if type(target) is str else kind, 0, 0)
        sites = req.sites
        entry = sites.get(key)
        if entry is None:
            call.stack = stack = stacks.capture(frame)
            sites[key] = (stack, 1)
        elif entry[1] < _stacks_per_site:
            call.stack = stack = stacks.capture(frame)
            sites[key] = (stack, entry[1] + 1)
        else:
            call.stack = entry[0]
        call.start = _perf()
        calls.append(call)
        return call
    except Exception:
        internal_error()
        return None


def attr(name: str, value: Any) -> None:
    """Attach a custom attribute (number or short string) to the current request."""
    req = _current.get()
    if req is None:
        return
    try:
        if req.attrs is None:
            req.attrs = {}
        if len(req.attrs) < MAX_ATTRS or name in req.attrs:
            if isinstance(value, str) and len(value) > MAX_ATTR_CHARS:
                value = value[:MAX_ATTR_CHARS]
            req.attrs[str(name)] = value
    except Exception:
        internal_error()


def tag(name: str, value: Any) -> None:
    """Tag the current request (e.g. a feature-flag variant) for later comparison."""
    req = _current.get()
    if req is None:
        return
    try:
        if req.tags is None:
            req.tags = {}
        if len(req.tags) < MAX_ATTRS or name in req.tags:
            req.tags[str(name)] = str(value)[:MAX_ATTR_CHARS]
    except Exception:
        internal_error()


def set_user(user: Any = None, tenant: Any = None) -> None:
    """Name the user and/or tenant of the current request from application code."""
    req = _current.get()
    if req is None:
        return
    if user is not None:
        req.user = str(user)[:256]
    if tenant is not None:
        req.tenant = str(tenant)[:256]


F = TypeVar("F", bound=Callable[..., Any])


class task:
    """Record a unit of background work as a request of kind ``background``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._req: ActiveRequest | None = None

    def __enter__(self) -> task:
        self._req = begin("background", "TASK", self.name, cpu=True)
        if self._req is not None:
            self._req.endpoint = self.name
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        req, self._req = self._req, None
        if req is not None:
            req.status = 500 if exc_type is not None else 200
            if exc_type is not None:
                req.error = exc_type.__name__
            end(req)

    def __call__(self, fn: F) -> F:
        name = self.name
        if _is_coroutine_function(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                with task(name):
                    return await fn(*args, **kwargs)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with task(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def _is_coroutine_function(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


@contextmanager
def suppressed() -> Iterator[None]:
    """Run a block without recording (the agent's own I/O, for instance)."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)
